"""Tokens have a lifecycle (issue 20, item 3): listed without secrets, revoked (on every
replica within KVWATCH_TOKEN_CACHE_S), expired, rotated with a grace period during which a
probe's events keep their owner; each operation is audited, on the CLI and the admin API. A
probe whose token is refused says so once, as an error, and keeps its events for the next
token."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text
from typer.testing import CliRunner

from engine_probe import events as ev
from engine_probe.probe import Probe
from engine_probe.settings import ProbeSettings
from kvwatch.cli import app as cli
from tests import factories as f
from tests.conftest import Collector
from tests.probe_helpers import exporter_threads, wait_for


def _cli(db_url: str, *args: str) -> Any:
    return CliRunner().invoke(cli, [*args, "--database-url", db_url])


def _audit(db_url: str) -> list[tuple[str, str]]:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT action, subject FROM audit_log ORDER BY id"))
            return [(str(a), str(s)) for a, s in rows]
    finally:
        engine.dispose()


def _ingest(url: str, token: str, seq: int, probe: str = "p-life") -> int:
    r = httpx.post(
        f"{url}/v1/events",
        json=[f.as_json(f.pool(seq, probe=probe))],
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    return r.status_code


def test_the_cli_creates_lists_revokes_and_rotates(collector: Collector) -> None:
    db = collector.db_url
    made = _cli(db, "tokens", "create", "--kind", "ingest", "--deployment", "glm-prod",
                "--name", "probe-glm", "--expires-in", "90d")  # fmt: skip
    assert made.exit_code == 0, made.output
    secret = made.stdout.strip().splitlines()[-1]
    assert secret.startswith("kvw_ingest_") and "valid until" in made.stderr
    # a name means one token: a second valid token of that name is refused
    again = _cli(db, "tokens", "create", "--kind", "read", "--name", "probe-glm")
    assert again.exit_code == 2 and "already named 'probe-glm'" in again.output
    listed = _cli(db, "tokens", "list", "--json")
    assert listed.exit_code == 0, listed.output
    docs = {d["name"]: d for d in json.loads(listed.stdout)}
    mine = docs["probe-glm"]
    assert (mine["kind"], mine["deployment_id"], mine["state"]) == ("ingest", "glm-prod", "valid")
    assert mine["expires_at"] is not None and secret not in listed.stdout
    assert secret[:16] == mine["prefix"] and "token_hash" not in mine
    table = _cli(db, "tokens", "list")
    assert "probe-glm" in table.stdout and "deployment=glm-prod" in table.stdout

    assert _ingest(collector.url, secret, 1) == 200
    # rotate: a new token, same scope and name; the old one still works during the grace
    rotated = _cli(db, "tokens", "rotate", "probe-glm", "--grace", "1h")
    assert rotated.exit_code == 0, rotated.output
    new = rotated.stdout.strip().splitlines()[-1]
    assert new.startswith("kvw_ingest_") and new != secret
    assert _ingest(collector.url, secret, 2) == 200
    # ... and the probe's events stay its own under the new token (one lineage)
    assert _ingest(collector.url, new, 3) == 200
    docs = json.loads(_cli(db, "tokens", "list", "--json").stdout)
    lineage = [d for d in docs if d["name"] == "probe-glm"]
    assert len(lineage) == 2 and len({d["lineage_id"] for d in lineage}) == 1
    assert lineage[0]["expires_at"] < lineage[1]["expires_at"]  # the old one goes first

    # revoke by name: two valid tokens of one lineage share it, the newest is meant
    gone = _cli(db, "tokens", "revoke", str(lineage[0]["id"]))
    assert gone.exit_code == 0 and "revoked" in gone.output
    assert _cli(db, "tokens", "revoke", "no-such-token").exit_code == 2
    actions = [a for a, _ in _audit(db)]
    for action in ("token.create", "token.rotate", "token.revoke"):
        assert action in actions, actions


def _get(url: str, **kw: Any) -> httpx.Response:
    return httpx.get(url, timeout=30, **kw)  # a busy machine answers slower than httpx's 5 s


def _post(url: str, **kw: Any) -> httpx.Response:
    return httpx.post(url, timeout=30, **kw)


def test_revoked_and_expired_tokens_stop_working(tmp_path: Path) -> None:
    """On a running collector, within KVWATCH_TOKEN_CACHE_S (1 s here) of the change."""
    from collector import migrate
    from collector.app import create_app
    from collector.settings import Settings
    from kvwatch.embedded import serve_in_thread
    from tests.conftest import make_token

    db_url = f"sqlite:///{tmp_path / 'kvwatch.db'}"
    migrate.upgrade(db_url)
    settings = Settings(database_url=db_url, auto_migrate=False, token_cache_s=1.0)
    with serve_in_thread(create_app(settings)) as url:
        admin = make_token(db_url, "admin")
        h = {"Authorization": f"Bearer {admin}"}
        made = _post(
            f"{url}/v1/tokens", json={"kind": "read", "name": "dash", "expires_in": "2s"},
            headers=h,
        ).json()  # fmt: skip
        short = made["secret"]
        assert made["token"]["state"] == "valid" and "secret" not in made["token"]
        assert _get(f"{url}/v1/deployments", headers={"Authorization": f"Bearer {short}"})
        wait_for(
            lambda: (
                _get(
                    f"{url}/v1/deployments", headers={"Authorization": f"Bearer {short}"}
                ).status_code
                == 401
            ),
            10,
            "the 2-second token to expire",
        )
        r = _get(f"{url}/v1/deployments", headers={"Authorization": f"Bearer {short}"})
        assert "expired at" in r.json()["error"]["message"]

        kept = _post(f"{url}/v1/tokens", json={"kind": "ingest"}, headers=h).json()
        token, tid = kept["secret"], kept["token"]["id"]
        assert _ingest(url, token, 1) == 200  # now cached by the collector
        revoked = _post(f"{url}/v1/tokens/{tid}/revoke", headers=h).json()
        assert revoked["state"] == "revoked"
        # bounded: the cache holds a token 1 s here; the deadline leaves room for a busy machine
        wait_for(lambda: _ingest(url, token, 2) == 401, 10, "the revocation to take effect")
        listed = _get(f"{url}/v1/tokens", headers=h).json()
        assert {d["id"]: d["state"] for d in listed}[tid] == "revoked"
        assert all("secret" not in d and "token_hash" not in d for d in listed)
        # a revoked token is rotated (its replacement answers for its probes) and stays revoked
        rotated = _post(f"{url}/v1/tokens/{tid}/rotate", headers=h)
        assert rotated.status_code == 201, rotated.text
        assert rotated.json()["old"]["state"] == "revoked"
        assert _ingest(url, token, 3) == 401
        bad = _post(f"{url}/v1/tokens", json={"kind": "read", "expires_in": "soon"}, headers=h)
        assert bad.status_code == 422 and "expires_in" in bad.text


def _audit_by(db_url: str, actor: str) -> list[tuple[str, str]]:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT action, subject FROM audit_log WHERE actor = :a "
                    "AND action <> 'token.use' ORDER BY id"
                ),
                {"a": actor},
            )
            return [(str(a), str(s)) for a, s in rows]
    finally:
        engine.dispose()


def test_a_revocation_reaches_every_replica_within_the_cache_time(db_url: str) -> None:
    """Two collectors on one database: a token revoked through A is refused by B, which had
    it cached, once B's KVWATCH_TOKEN_CACHE_S has passed. Polled with a deadline: what is
    asserted is that B stops accepting it, not how fast a busy machine gets there."""
    from collector import migrate
    from collector.app import create_app
    from collector.settings import Settings
    from kvwatch.embedded import serve_in_thread
    from tests.conftest import make_token

    migrate.upgrade(db_url)
    settings = Settings(database_url=db_url, auto_migrate=False, token_cache_s=0.5)
    with (
        serve_in_thread(create_app(settings)) as a,
        serve_in_thread(create_app(settings)) as b,
    ):
        h = {"Authorization": f"Bearer {make_token(db_url, 'admin')}"}
        made = httpx.post(f"{a}/v1/tokens", json={"kind": "ingest", "name": "p-b"}, headers=h)
        assert made.status_code == 201, made.text
        token, tid = made.json()["secret"], made.json()["token"]["id"]
        for seq in (1, 2):  # accepted on B, and so in B's cache
            assert _ingest(b, token, seq) == 200
        revoked = httpx.post(f"{a}/v1/tokens/{tid}/revoke", headers=h, timeout=30)
        assert revoked.status_code == 200 and revoked.json()["state"] == "revoked"
        refused: list[httpx.Response] = []

        def b_refuses() -> bool:
            r = httpx.get(
                f"{b}/v1/verifications", headers={"Authorization": f"Bearer {token}"}, timeout=30
            )
            refused[:] = [r]
            return r.status_code == 401

        wait_for(b_refuses, 30, "replica B to refuse the token revoked through A")
        assert "revoked" in refused[0].json()["error"]["message"]
        assert _ingest(b, token, 3) == 401 and _ingest(a, token, 3) == 401


def test_token_operations_through_the_api_are_audited_with_the_admin_as_actor(
    collector: Collector,
) -> None:
    from tests.conftest import make_token

    admin = make_token(collector.db_url, "admin", name="ops-admin")
    with collector.client(admin) as c:
        made = c.post("/v1/tokens", json={"kind": "ingest", "deployment_id": "d-1"})
        assert made.status_code == 201, made.text
        first = made.json()["token"]["id"]
        rotated = c.post(f"/v1/tokens/{first}/rotate", json={"grace": "1h"})
        assert rotated.status_code == 201, rotated.text
        second = rotated.json()["token"]["id"]
        assert c.post(f"/v1/tokens/{second}/revoke").status_code == 200
    assert _audit_by(collector.db_url, "ops-admin") == [
        ("token.create", f"token:{first}"),
        ("token.create", f"token:{second}"),  # the rotation's new token
        ("token.rotate", f"token:{first}"),
        ("token.revoke", f"token:{second}"),
        ("token.revoke", f"token:{first}"),  # the generation it replaced, with it
    ]


def test_a_token_ref_is_an_id_only_in_ascii_digits(collector: Collector) -> None:
    """Found guarding the fuzz: the lookup took any Unicode digit for an id, so a full-width
    "1" (U+FF11) revoked token #1 (the caller's own admin token, here) and a superscript two
    (U+00B2) was a 500. An id is ASCII digits within 63 bits; anything else is looked up as a
    name (a 404 here)."""
    with collector.client(collector.admin) as c:
        mine = next(d for d in c.get("/v1/tokens").json() if d["prefix"] == collector.admin[:16])
        wide = "".join(chr(0xFF10 + int(d)) for d in str(mine["id"]))
        for ref in (wide, "\u00b2", "9" * 30, f" {mine['id']}"):
            for op in ("revoke", "rotate"):
                r = c.post(f"/v1/tokens/{ref}/{op}")
                assert r.status_code == 404, (ref, op, r.status_code, r.text)
                assert r.json()["error"]["code"] == "not_found"
        assert c.get("/v1/tokens").status_code == 200  # still ours


def test_a_probe_whose_token_is_rotated_out_says_so_once_and_keeps_its_events(
    collector: Collector, probes: list[Probe], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = collector.db_url
    made = _cli(db, "tokens", "create", "--kind", "ingest", "--name", "engine-0-token")
    old = made.stdout.strip().splitlines()[-1]
    spool = tmp_path / "spool"

    def settings(token: str) -> ProbeSettings:
        return ProbeSettings(
            collector_url=collector.url,
            ingest_token=token,
            deployment_id="real-dep",
            probe_id="engine-0",
            probe_spool_dir=spool,
            probe_batch_size=5,
            probe_flush_interval_s=0.05,
            probe_backoff_base_s=0.01,
            probe_backoff_max_s=0.05,
        )

    first = Probe(settings(old))
    probes.append(first)
    for i in range(5):
        assert first.emit(ev.PoolSample, capacity_tokens=10**6, used_tokens=i, free_tokens=0)
    assert first.force_flush(10)
    # rotated with no grace: the running probe's token is refused from now on
    rotated = _cli(db, "tokens", "rotate", "engine-0-token", "--grace", "0s")
    assert rotated.exit_code == 0, rotated.output
    new = rotated.stdout.strip().splitlines()[-1]
    time.sleep(5.5)  # the collector's token cache (KVWATCH_TOKEN_CACHE_S, 5 s)
    caplog.set_level(logging.INFO, logger="engine_probe.exporter")
    for i in range(5, 15):
        assert first.emit(ev.PoolSample, capacity_tokens=10**6, used_tokens=i, free_tokens=0)
    wait_for(lambda: first.stats()["spooled"]["files"] > 0, 10, "the refused batches to spool")
    time.sleep(0.5)  # several more refused attempts
    loud = [r for r in caplog.records if "refused its token" in r.getMessage()]
    assert len(loud) == 1 and loud[0].levelno == logging.ERROR, [r.getMessage() for r in loud]
    assert "configuration error, not an outage" in loud[0].getMessage()
    assert sum(first.stats()["dropped"].values()) == 0
    first.shutdown(1.0)
    assert first.stats()["spooled"]["files"] > 0  # the refused events wait on disk
    wait_for(lambda: not exporter_threads(), 10, "the first probe's exporter to end")
    # the same engine restarted with the new token: the spool goes out under it
    second = Probe(settings(new))
    probes.append(second)
    # (its exporter, which adopts the spool, starts with its first event)
    assert second.emit(ev.PoolSample, capacity_tokens=10**6, used_tokens=99, free_tokens=0)
    assert second.force_flush(20)
    assert second.stats()["adopted_files"] > 0
    wait_for(lambda: second.stats()["spooled"]["files"] == 0, 20, "the spool to drain")
    engine = create_engine(db)
    try:
        with engine.connect() as conn:
            used = (
                conn.execute(
                    text("SELECT used_tokens FROM pool_samples WHERE probe_id = :p ORDER BY seq"),
                    {"p": first.probe_id},
                )
                .scalars()
                .all()
            )
    finally:
        engine.dispose()
    rejected = list((spool / "rejected").glob("*.txt"))
    assert used == list(range(15)), (used, [p.read_text()[:300] for p in rejected])


# -- issue 40, finding 3: revoking means revoked -------------------------------------------


def _until(what: str, check: Any, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_revoking_after_a_rotation_revokes_the_leaked_secret_too(collector: Collector) -> None:
    """The old secret (usually the leaked one, the reason for the rotation) had kept working
    for the rest of its grace period after `tokens revoke NAME` revoked only the new one."""
    db = collector.db_url
    leaked = _cli(db, "tokens", "create", "--kind", "ingest", "--name", "engine-a")
    leaked_secret = leaked.stdout.strip().splitlines()[-1]
    rotated = _cli(db, "tokens", "rotate", "engine-a", "--grace", "24h")
    new_secret = rotated.stdout.strip().splitlines()[-1]
    assert _ingest(collector.url, leaked_secret, 1, "p-a") == 200
    assert _ingest(collector.url, new_secret, 2, "p-a") == 200
    gone = _cli(db, "tokens", "revoke", "engine-a")
    assert gone.exit_code == 0, gone.output
    assert "with the tokens it replaced" in gone.stderr, gone.stderr
    _until("the leaked secret to be refused", lambda: _ingest(collector.url, leaked_secret, 3,
                                                               "p-a") == 401)  # fmt: skip
    # each secret was cached when it was last accepted, the new one after the leaked one, so
    # its cache entry may outlive the leaked one's by a moment (the authenticator's ttl_s)
    _until("the new secret to be refused", lambda: _ingest(collector.url, new_secret, 4,
                                                           "p-a") == 401)  # fmt: skip
    states = {d["id"]: d["state"] for d in json.loads(_cli(db, "tokens", "list", "--json").stdout)}
    assert sorted(states.values()).count("revoked") == 2

    # --keep-previous: only the one named; the one it replaced keeps its grace period
    kept = _cli(db, "tokens", "create", "--kind", "ingest", "--name", "engine-b")
    old_b = kept.stdout.strip().splitlines()[-1]
    new_b = _cli(db, "tokens", "rotate", "engine-b").stdout.strip().splitlines()[-1]
    gone = _cli(db, "tokens", "revoke", "engine-b", "--keep-previous")
    assert gone.exit_code == 0 and "replaced" not in gone.stderr, gone.output
    _until("the new token to be refused", lambda: _ingest(collector.url, new_b, 1, "p-b") == 401)
    assert _ingest(collector.url, old_b, 2, "p-b") == 200

    # the API says what it revoked
    with collector.client(collector.admin) as c:
        made = c.post("/v1/tokens", json={"kind": "read", "name": "dash"}).json()["token"]
        newer = c.post(f"/v1/tokens/{made['id']}/rotate").json()["token"]
        r = c.post(f"/v1/tokens/id:{newer['id']}/revoke")
        assert r.status_code == 200 and r.json()["also_revoked"] == [made["id"]], r.text
        r = c.post(f"/v1/tokens/%23{newer['id']}/revoke")  # again: nothing more to revoke
        assert r.status_code == 200 and r.json()["also_revoked"] == [], r.text


def test_ids_and_names_cannot_be_confused(collector: Collector) -> None:
    """A token named "18" was shadowed by token #18 in `revoke 18`. New names of digits only
    are refused; `name:` reaches any name an older version allowed, `#` and `id:` an id."""
    db = collector.db_url
    refused = _cli(db, "tokens", "create", "--kind", "read", "--name", "18")
    assert refused.exit_code == 2 and "digits only" in refused.output, refused.output
    with collector.client(collector.admin) as c:
        r = c.post("/v1/tokens", json={"kind": "read", "name": "007"})
        assert r.status_code == 422 and r.json()["error"]["details"] == {"field": "name"}
        victim = c.post("/v1/tokens", json={"kind": "read", "name": "victim"}).json()["token"]
        odd = c.post("/v1/tokens", json={"kind": "read", "name": "odd"}).json()["token"]
    engine = create_engine(db)
    try:  # as an older version allowed: a token named with the victim's id
        with engine.begin() as conn:
            conn.execute(
                text("UPDATE api_tokens SET name = :n, name_held = :n WHERE id = :i"),
                {"n": str(victim["id"]), "i": odd["id"]},
            )
    finally:
        engine.dispose()
    gone = _cli(db, "tokens", "revoke", f"name:{victim['id']}")
    assert gone.exit_code == 0, gone.output
    assert f"token #{odd['id']}" in gone.stderr, gone.stderr
    states = {d["id"]: d["state"] for d in json.loads(_cli(db, "tokens", "list", "--json").stdout)}
    assert (states[victim["id"]], states[odd["id"]]) == ("valid", "revoked")
    assert _cli(db, "tokens", "revoke", "#x1").exit_code == 2


def test_a_revoked_ingest_token_is_rotated_and_its_replacement_delivers_for_its_probe_ids(
    collector: Collector,
) -> None:
    """A revoked (or expired) ingest token could not be rotated, and a new token got 403 on
    the old probe ids: what the probe had spooled under them could never be delivered."""
    db = collector.db_url
    made = _cli(db, "tokens", "create", "--kind", "ingest", "--name", "engine-c")
    first = made.stdout.strip().splitlines()[-1]
    assert _ingest(collector.url, first, 1, "p-c") == 200
    assert _cli(db, "tokens", "revoke", "engine-c").exit_code == 0
    fresh = _cli(db, "tokens", "create", "--kind", "ingest", "--name", "unrelated")
    assert _ingest(collector.url, fresh.stdout.strip().splitlines()[-1], 2, "p-c") == 403
    docs = json.loads(_cli(db, "tokens", "list", "--json").stdout)
    (revoked,) = [d for d in docs if d["name"] == "engine-c"]
    rotated = _cli(db, "tokens", "rotate", str(revoked["id"]))
    assert rotated.exit_code == 0, rotated.output
    assert "was already revoked" in rotated.stderr, rotated.stderr
    replacement = rotated.stdout.strip().splitlines()[-1]
    assert _ingest(collector.url, replacement, 2, "p-c") == 200  # the probe's own, still
    # and the name went with it: the replacement answers to it
    docs = json.loads(_cli(db, "tokens", "list", "--json").stdout)
    valid = [d for d in docs if d["name"] == "engine-c" and d["state"] == "valid"]
    assert len(valid) == 1 and valid[0]["lineage_id"] == revoked["id"]


def test_two_replicas_creating_one_name_at_once_do_not_both_succeed(db_url: str) -> None:
    """Two collectors each checked the name was free, then both inserted it. The database
    now holds the name under a unique index: the second one waits for the first and loses."""
    import threading

    from collector import migrate
    from collector.db import Database
    from collector.errors import Conflict
    from collector.timefmt import to_micros
    from collector.tokens import create_token
    from engine_probe.events import utcnow

    migrate.upgrade(db_url)
    first_db, second_db = Database(db_url), Database(db_url)
    inserted, outcome = threading.Event(), {}

    def first() -> None:
        with first_db.write() as conn:
            create_token(conn, kind="read", name="shared", now_us=to_micros(utcnow()))
            inserted.set()
            time.sleep(1.0)  # the second replica's check runs while this is uncommitted

    def second() -> None:
        assert inserted.wait(10)
        try:
            with second_db.write() as conn:
                create_token(conn, kind="read", name="shared", now_us=to_micros(utcnow()))
            outcome["second"] = "created"
        except Conflict as exc:
            outcome["second"] = exc.message

    try:
        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert "already named 'shared'" in outcome["second"], outcome
        with first_db.read() as conn:
            n = conn.execute(text("SELECT count(*) FROM api_tokens WHERE name = 'shared'"))
            assert n.scalar_one() == 1
    finally:
        first_db.dispose()
        second_db.dispose()
