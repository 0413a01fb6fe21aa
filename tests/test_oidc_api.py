"""The collector accepts people signed in at a real OpenID Connect provider (oidc-provider on
loopback, tests/oidc_provider.py): their ID tokens verified against the provider's published
keys, their roles from its group claim through a role map, every refusal a 401 or 403 that
says why, a rotated key picked up, machine tokens unchanged, and the audit log naming each
person. Over SQLite and PostgreSQL."""

from __future__ import annotations

import hashlib
import hmac
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from joserfc import jwt
from joserfc.jwk import RSAKey

from collector.errors import Forbidden, InvalidInput
from collector.oidc import RoleMap, principal_for
from tests import oidc_world as w
from tests.conftest import Collector
from tests.oidc_provider import OidcProvider, b64url

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js")


@pytest.fixture
def op(tmp_path: Path) -> Iterator[OidcProvider]:
    with w.provider(tmp_path) as p:
        yield p


@pytest.fixture
def c(db_url: str, op: OidcProvider, tmp_path: Path) -> Iterator[Collector]:
    # a kid the collector has not seen makes it read the keys again at once (the default
    # waits 30 s between such reads)
    with w.collector(db_url, op, tmp_path, oidc_jwks_refetch_s=0) as col:
        yield col


def _get(c: Collector, token: str | None, path: str, **kw: Any) -> httpx.Response:
    with c.client(token) as h:
        return h.get(path, **kw)


def _post(c: Collector, token: str | None, path: str, body: Any = None) -> httpx.Response:
    with c.client(token) as h:
        return h.post(path, json=body)


def _id_token(op: OidcProvider, user: str) -> str:
    return str(op.login(w.CLIENT_ID, user)["id_token"])


def test_each_role_gets_what_it_may_do(c: Collector, op: OidcProvider) -> None:
    alert = w.seed_incident(c)
    people = {u: _id_token(op, u) for u in ("ada", "olive", "audrey", "tess")}

    me = {u: _get(c, t, "/v1/whoami").json() for u, t in people.items()}
    assert me["olive"]["role"] == "operator" and me["olive"]["may"] == ["read", "report", "respond"]
    assert me["olive"]["person"] == {
        "subject": "olive",
        "email": "olive@operator.test",
        "name": "Olive Oncall",
        "issuer": op.issuer,
    }
    assert me["audrey"]["role"] == "auditor" and me["audrey"]["may"] == ["read", "report"]
    assert me["ada"]["kind"] == "admin" and "admin" in me["ada"]["may"]
    assert me["tess"]["role"] == "tenant:acme" and me["tess"]["tenant"] == w.ACME
    assert me["tess"]["may"] == ["read"]
    assert me["olive"]["expires_at"] is not None

    # the auditor reads everything and the reports, and changes nothing
    auditor = people["audrey"]
    assert _get(c, auditor, "/v1/alerts").status_code == 200
    assert _get(c, auditor, "/v1/reports").status_code == 200
    r = _post(c, auditor, f"/v1/alerts/{alert['id']}/ack", {"comment": "looking"})
    assert r.status_code == 403 and "the auditor role cannot do this" in r.text, r.text
    assert _post(c, auditor, "/v1/tokens", {"kind": "read"}).status_code == 403

    # the operator acknowledges, as themselves whatever the body claims
    r = _post(c, people["olive"], f"/v1/alerts/{alert['id']}/ack", {"by": "someone else"})
    assert r.status_code == 200, r.text
    got = _get(c, people["olive"], f"/v1/alerts/{alert['id']}").json()
    assert got["acked_by"] == "olive@operator.test (oidc sub olive)", got
    report = _post(c, people["olive"], "/v1/reports", {"kind": "review"})
    assert report.status_code == 201, report.text
    assert _get(c, people["olive"], "/v1/tokens").status_code == 403  # admin's, not theirs

    # the tenant's contact: acme's side of the incident only, as a tenant-scoped token
    tenant = people["tess"]
    assert _get(c, tenant, "/v1/alerts").status_code == 403
    incidents = _get(c, tenant, "/v1/incidents").json()
    assert len(incidents) == 1 and "globex" not in str(incidents).lower(), incidents
    r = _get(c, tenant, "/v1/requests", params={"tenant": w.GLOBEX})
    assert r.status_code == 403, r.text

    # the audit log names each person, and the chain still verifies
    rows = w.audit_rows(c.db_url)
    uses = {r["detail"]["subject"]: r for r in rows if r["action"] == "person.use"}
    assert set(uses) == {"ada", "olive", "audrey", "tess"}
    assert uses["tess"]["detail"]["role"] == "tenant:acme"
    assert uses["tess"]["actor"] == "tess@acme.test (oidc sub tess)"
    acks = [r for r in rows if r["action"] == "alert.ack"]
    assert [a["actor"] for a in acks] == ["olive@operator.test (oidc sub olive)"], acks
    made = [r for r in rows if r["action"].startswith("report.")]
    assert made and made[-1]["actor"] == "olive@operator.test (oidc sub olive)", made
    verified = _get(c, auditor, "/v1/audit/verify").json()
    assert verified["ok"] is True, verified


def test_a_person_without_a_role_is_refused_and_named(c: Collector, op: OidcProvider) -> None:
    for user in ("nemo", "stranger"):  # a group the map does not know; no groups at all
        r = _get(c, _id_token(op, user), "/v1/whoami")
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["details"]["reason"] == "no_role", err
        assert "has no kvwatch role" in err["message"] and "'groups' claim" in err["message"]
    refused = [r for r in w.audit_rows(c.db_url) if r["action"] == "person.refused"]
    # the provider has not verified the stranger's address: the subject alone names them
    assert [r["actor"] for r in refused] == [
        "nemo@operator.test (oidc sub nemo)",
        "oidc sub stranger",
    ], refused


@pytest.mark.parametrize(
    ("case", "reason", "words"),
    [
        ("expired", "expired", "expired at"),
        ("wrong_audience", "audience", "this collector accepts 'kvwatch-dashboard'"),
        ("wrong_issuer", "issuer", "this collector trusts"),
        ("unknown_key", "unknown_key", "a key the issuer does not publish"),
        ("alg_none", "algorithm", "accepted algorithms"),
        ("hmac_with_public_key", "algorithm", "accepted algorithms"),
        ("no_subject", "missing_claim", "has no"),
        ("not_yet_valid", "invalid_claim", "not valid yet"),
        ("issued_in_the_future", "invalid_claim", "not valid yet"),
        ("bad_signature", "bad_signature", "does not verify"),
    ],
)
def test_bad_tokens_are_refused_with_the_reason(
    c: Collector, op: OidcProvider, case: str, reason: str, words: str
) -> None:
    good = op.id_token_claims("olive", w.CLIENT_ID)
    now = int(time.time())
    token = {
        # past the 60 s of clock skew the collector allows
        "expired": lambda: op.sign({**good, "iat": now - 900, "exp": now - 120}),
        "wrong_audience": lambda: op.sign({**good, "aud": "another-app"}),
        "wrong_issuer": lambda: op.sign({**good, "iss": "http://127.0.0.1:9/other"}),
        "unknown_key": lambda: op.sign(
            good,
            key=RSAKey.generate_key(2048, parameters={"kid": "not-published"}, private=True),
        ),
        "alg_none": lambda: op.unsigned(good, header_extra={"kid": op.signing_key.kid}),
        # the published RSA key used as an HMAC secret: proves nothing, must not pass
        "hmac_with_public_key": lambda: _hs256(good, op.signing_key),
        "no_subject": lambda: op.sign({k: v for k, v in good.items() if k != "sub"}),
        "not_yet_valid": lambda: op.sign({**good, "nbf": now + 900}),
        "issued_in_the_future": lambda: op.sign({**good, "iat": now + 900}),
        "bad_signature": lambda: _tamper(op.sign(good)),
    }[case]()
    r = _get(c, token, "/v1/whoami")
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert err["code"] == "unauthorized" and err["details"]["reason"] == reason, err
    assert words in err["message"], err["message"]
    assert "Traceback" not in r.text


def _hs256(claims: dict[str, Any], published: RSAKey) -> str:
    """HS256 over the claims with the published key's PEM as the secret, by hand (JOSE
    libraries, rightly, refuse to build it): the algorithm-confusion attack."""
    header = {"alg": "HS256", "typ": "JWT", "kid": published.kid}
    signing_input = ".".join(
        b64url(json.dumps(part, separators=(",", ":")).encode()) for part in (header, claims)
    )
    secret = published.as_pem(private=False)
    mac = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{b64url(mac)}"


def _tamper(token: str) -> str:
    head, body, sig = token.split(".")
    flipped = ("A" if sig[10] != "A" else "B").join((sig[:10], sig[11:]))
    return ".".join((head, body, flipped))


def test_clock_skew_is_bounded_and_expiry_is_not_stretched(c: Collector, op: OidcProvider) -> None:
    now = int(time.time())
    claims = op.id_token_claims("olive", w.CLIENT_ID)
    # the issuer's clock 30 s ahead of ours: within the 60 s allowed
    ahead = op.sign(claims | {"iat": now + 30, "nbf": now + 30})
    assert _get(c, ahead, "/v1/whoami").status_code == 200
    # an expiry stands as the issuer set it: 5 s late is late
    late = op.sign(claims | {"iat": now - 600, "exp": now - 5})
    r = _get(c, late, "/v1/whoami")
    assert r.status_code == 401 and r.json()["error"]["details"]["reason"] == "expired", r.text


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        # issued to another client that named this one too (OIDC Core 3.1.3.7: azp)
        ({"aud": ["another-app", w.CLIENT_ID], "azp": "another-app"}, "audience"),
        ({"aud": ["another-app", w.CLIENT_ID]}, "audience"),
        # other JWTs the issuer signs for this client are not ID tokens
        ({"events": {"http://schemas.openid.net/event/backchannel-logout": {}}}, "not_an_id_token"),
        ({"exp": 10**13}, "missing_claim"),
        ({"exp": "tomorrow"}, "missing_claim"),
    ],
)
def test_tokens_that_are_not_this_clients_id_tokens_are_refused(
    c: Collector, op: OidcProvider, change: dict[str, Any], reason: str
) -> None:
    token = op.sign(op.id_token_claims("olive", w.CLIENT_ID) | change)
    r = _get(c, token, "/v1/whoami")
    assert r.status_code == 401 and r.json()["error"]["details"]["reason"] == reason, r.text


def test_an_access_token_typed_jwt_is_not_an_id_token(c: Collector, op: OidcProvider) -> None:
    token = op.sign(op.id_token_claims("olive", w.CLIENT_ID), header_extra={"typ": "at+jwt"})
    r = _get(c, token, "/v1/whoami")
    assert r.status_code == 401 and r.json()["error"]["details"]["reason"] == "not_an_id_token"


def test_an_unverified_or_huge_email_does_not_name_the_person(
    c: Collector, op: OidcProvider
) -> None:
    claims = op.id_token_claims("olive", w.CLIENT_ID)
    unverified = op.sign(claims | {"email": "ceo@operator.test", "email_verified": False})
    assert _get(c, unverified, "/v1/whoami").json()["name"] == "oidc sub olive"
    huge = op.sign(claims | {"email": "e" * 5000 + "@operator.test", "sub": "s" * 5000})
    r = _get(c, huge, "/v1/whoami")
    assert r.status_code == 200 and len(r.json()["name"]) <= 256, r.text
    uses = [r for r in w.audit_rows(c.db_url) if r["action"] == "person.use"]
    assert len(uses) == 2 and all(len(u["actor"]) <= 256 for u in uses)


def test_a_rotated_signing_key_is_picked_up(c: Collector, op: OidcProvider) -> None:
    before = _id_token(op, "olive")
    assert _get(c, before, "/v1/whoami").status_code == 200  # the collector has the old keys
    old_kid = op.signing_key.kid
    op.rotate()
    assert op.signing_key.kid != old_kid
    after = _id_token(op, "olive")
    r = _get(c, after, "/v1/whoami")
    assert r.status_code == 200, r.text
    assert _get(c, before, "/v1/whoami").status_code == 200  # the old key is still published


def test_unknown_kids_do_not_flood_the_issuer(
    db_url: str, op: OidcProvider, tmp_path: Path
) -> None:
    """A made-up kid makes the collector read the keys again at most once per
    KVWATCH_OIDC_JWKS_REFETCH_S: until then a rotated key waits too."""
    with w.collector(db_url, op, tmp_path, oidc_jwks_refetch_s=3600) as col:
        assert _get(col, _id_token(op, "olive"), "/v1/whoami").status_code == 200
        op.rotate()
        r = _get(col, _id_token(op, "olive"), "/v1/whoami")
        assert r.status_code == 401 and "does not publish" in r.text, r.text


def test_machine_tokens_work_beside_people(c: Collector, op: OidcProvider) -> None:
    assert _get(c, c.admin, "/v1/whoami").json()["kind"] == "admin"
    assert _get(c, c.admin, "/v1/whoami").json()["person"] is None
    tenant_token = c.token("read", tenant=w.ACME)
    assert _get(c, tenant_token, "/v1/whoami").json()["tenant"] == w.ACME
    fake = "kvw_read_" + "x" * 43
    assert _get(c, fake, "/v1/whoami").status_code == 401


def test_a_collector_without_an_issuer_refuses_id_tokens(
    collector: Collector, op: OidcProvider
) -> None:
    r = _get(collector, _id_token(op, "ada"), "/v1/whoami")
    assert r.status_code == 401 and "KVWATCH_OIDC_ISSUER is not set" in r.text, r.text


def test_an_unreachable_issuer_is_a_503_not_a_500(db_url: str, tmp_path: Path) -> None:
    with w.provider(tmp_path) as op:
        token = _id_token(op, "olive")
        with w.collector(db_url, op, tmp_path) as col:
            op.stop()
            r = _get(col, token, "/v1/whoami")
            assert r.status_code == 503 and "discovery document" in r.text, r.text
            assert _get(col, col.admin, "/v1/whoami").status_code == 200  # tokens still work


# ------------------------------------------------------------------ the role mapping itself


def test_the_role_map_gives_the_strongest_role_and_one_tenant(tmp_path: Path) -> None:
    path = tmp_path / "roles.yaml"
    path.write_text(
        "roles:\n  oncall: operator\n  dpo: [auditor]\n  acme-sec: tenant:acme\n"
        "  globex-sec: tenant:globex\n",
        encoding="utf-8",
    )
    rm = RoleMap.load(path)

    def role(groups: Any, claim: str = "groups") -> str | None:
        claims = {"sub": "p", "email": "p@x.test"}
        cur: dict[str, Any] = claims
        *parents, last = claim.split(".")
        for part in parents:
            cur = cur.setdefault(part, {})
        cur[last] = groups
        return principal_for(claims, issuer="i", roles_claim=claim, role_map=rm).role

    assert role(["dpo", "oncall"]) == "operator"
    assert role(["acme-sec", "dpo"]) == "auditor"
    assert role("acme-sec") == "tenant:acme"  # a string claim
    assert role(["acme-sec"], claim="realm_access.roles") == "tenant:acme"
    with pytest.raises(Forbidden, match="more than one tenant"):
        role(["acme-sec", "globex-sec"])
    with pytest.raises(Forbidden, match="no kvwatch role"):
        role(["admin"])  # with a map, only the map's groups count
    # without a map, kvwatch:<role> is that role; a group merely named "admin" is nothing
    bare = principal_for(
        {"sub": "p", "roles": ["admin", "kvwatch:tenant:acme"]}, issuer="i", roles_claim="roles",
        role_map=RoleMap({}),
    )  # fmt: skip
    assert bare.role == "tenant:acme" and bare.tenant == "acme"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("roles:\n  oncall: superuser\n", "roles.oncall: 'superuser' is not a role"),
        ("- oncall\n", "a role map is one mapping"),
        ("roles: [\n", "not YAML"),
        ("roles:\n  oncall: []\n", "roles.oncall: give a role"),
    ],
)
def test_a_bad_role_map_is_refused_at_start_naming_the_entry(
    tmp_path: Path, text: str, words: str
) -> None:
    path = tmp_path / "roles.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(InvalidInput) as exc:
        RoleMap.load(path)
    assert str(path) in exc.value.message and words in exc.value.message, exc.value.message


@pytest.mark.parametrize(
    ("env", "words"),
    [
        (
            {"KVWATCH_OIDC_CLIENT_ID": "dash", "KVWATCH_OIDC_ROLE_MAP": "{map}"},
            "KVWATCH_OIDC_ROLE_MAP: {map}: roles.oncall: 'boss' is not a role",
        ),
        ({}, "KVWATCH_OIDC_ISSUER is set without KVWATCH_OIDC_CLIENT_ID"),
    ],
)
def test_serve_refuses_bad_sign_in_settings_in_one_line(
    tmp_path: Path, env: dict[str, str], words: str
) -> None:
    from typer.testing import CliRunner

    from kvwatch.cli import app

    path = tmp_path / "roles.yaml"
    path.write_text("roles:\n  oncall: boss\n", encoding="utf-8")
    env = {k: v.format(map=path) for k, v in env.items()}
    r = CliRunner().invoke(
        app,
        ["serve", "--database-url", f"sqlite:///{tmp_path / 'k.db'}"],
        env={"KVWATCH_OIDC_ISSUER": "http://127.0.0.1:9", **env},
    )
    assert r.exit_code == 2, r.output
    assert words.format(map=path) in " ".join(r.output.split()), r.output
    assert "Traceback" not in r.output


def test_a_silent_issuer_holds_one_request_not_the_collector(tmp_path: Path) -> None:
    """While one request waits for an issuer that accepts and never answers, every other
    sign-in is answered 503 at once (it would otherwise queue behind it, holding the
    collector's worker threads), and a token not even shaped as a JWT never reaches it."""
    import socket
    import threading

    from collector.errors import Unauthorized, Unavailable
    from collector.oidc import OidcVerifier
    from tests.oidc_provider import unsigned

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    accepted = threading.Event()
    conns: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = silent.accept()
            except OSError:
                return
            conns.append(conn)
            accepted.set()

    threading.Thread(target=serve, daemon=True).start()
    verifier = OidcVerifier(issuer=f"http://127.0.0.1:{port}", audience="dash", http_timeout_s=30)
    key = RSAKey.generate_key(2048, parameters={"kid": "k"}, private=True)
    token = jwt.encode({"alg": "RS256", "kid": "k"}, {"sub": "x"}, key)
    with pytest.raises(Unauthorized, match="not a signed JWT"):
        verifier.verify("a.b.c")
    with pytest.raises(Unauthorized, match="accepted algorithms"):
        verifier.verify(unsigned({"sub": "x"}))
    assert not accepted.is_set()  # neither reached the issuer

    first: list[BaseException] = []

    def wait_for_the_issuer() -> None:
        try:
            verifier.verify(token)
        except Unavailable as exc:
            first.append(exc)

    waiting = threading.Thread(target=wait_for_the_issuer)
    waiting.start()
    assert accepted.wait(30)
    for _ in range(5):
        with pytest.raises(Unavailable, match="being read"):
            verifier.verify(token)
    assert len(conns) == 1
    silent.close()
    for conn in conns:
        conn.close()  # the waiting read fails now
    waiting.join(60)
    assert first and "discovery document" in str(first[0])
    verifier.close()


def test_keys_past_their_cache_time_serve_while_the_issuer_is_down(
    db_url: str, tmp_path: Path
) -> None:
    with w.provider(tmp_path) as op:
        token = _id_token(op, "olive")
        with w.collector(db_url, op, tmp_path, oidc_jwks_cache_s=0.5) as col:
            assert _get(col, token, "/v1/whoami").status_code == 200
            op.stop()
            time.sleep(1)  # the keys' cache time has passed
            r = _get(col, token, "/v1/whoami")
            assert r.status_code == 200, r.text


def test_an_issuer_over_plain_http_elsewhere_is_refused() -> None:
    from pydantic import ValidationError

    from collector.settings import Settings

    with pytest.raises(ValidationError, match="https://"):
        Settings(oidc_issuer="http://idp.example.com", oidc_client_id="dash")
    assert Settings(oidc_issuer="http://127.0.0.1:8960", oidc_client_id="dash").oidc_issuer


def test_a_person_removed_from_the_group_loses_the_role_at_the_next_sign_in(
    c: Collector, op: OidcProvider
) -> None:
    """The documented bound: the ID token already issued keeps its role until it expires;
    the next sign-in reads the groups afresh."""
    before = _id_token(op, "olive")
    op.users["olive"] = {**op.users["olive"], "groups": []}  # the IdP's admin removes her
    op.rotate()  # the provider restarted with its new directory
    after = _id_token(op, "olive")
    assert _get(c, before, "/v1/whoami").json()["role"] == "operator"
    r = _get(c, after, "/v1/whoami")
    assert r.status_code == 403 and r.json()["error"]["details"]["reason"] == "no_role", r.text
