"""The CLI's tables and the times it prints, as a person reads them in an 80-column terminal:
no cell loses a character (a long id wraps, it is never cut with an ellipsis), every
elapsed time or age reads one way (``policies.durations.human_duration``: ``45s``, ``6m 49s``,
``3d 4h``), and an expired silence shows when it really ended."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from typer.testing import CliRunner

from kvwatch.cli import app
from policies.durations import human_duration
from tests import factories as f

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)

ANSI = re.compile(r"\x1b\[[0-9;]*m")
LONG_DEPLOYMENT = "glm-4.6-prod-eu-west-1-blue-green-canary-for-massive-dynamic-and-initech"
LONG_TOKEN_NAME = "ingest-for-the-eu-west-1-blue-green-canary-of-glm-4.6-rotated-quarterly"
LONG_PERSON = "dana.scully-mulder@compliance.massive-dynamic.example"


def kvwatch(db_url: str, *args: str) -> Any:
    r = CliRunner().invoke(
        app, [*args], env={"COLUMNS": "80", "KVWATCH_DATABASE_URL": db_url, "LINES": "50"}
    )
    assert r.exit_code == 0, r.output
    return r


def columns(table: str) -> dict[str, str]:
    """Each column of a rich table as one string, header and cells alike: its lines' pieces
    joined without line breaks or spaces, so a value that wrapped reads whole again."""
    lines = ANSI.sub("", table).splitlines()

    def joined(sep: str) -> list[str]:
        rows = [ln.split(sep)[1:-1] for ln in lines if ln.startswith(sep)]
        return ["".join("".join(p.split()) for p in parts) for parts in zip(*rows, strict=True)]

    names, cells = joined("┃"), joined("│")
    return dict(zip(names, cells or [""] * len(names), strict=True))


def assert_fits_80_uncut(text: str) -> None:
    text = ANSI.sub("", text)
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "…" not in text, text


def _stale_read(collector: Any, seconds_ago: float) -> None:
    ts = datetime.now(UTC) - timedelta(seconds=seconds_ago)
    with collector.client(collector.ingest) as c:
        event = f.stale_read(1, dep=LONG_DEPLOYMENT, ts=ts)
        assert c.post("/v1/events", json=[f.as_json(event)]).status_code == 200


def test_tables_at_80_columns_show_every_id_whole(collector: Any) -> None:
    db = collector.db_url
    _stale_read(collector, 409)
    kvwatch(db, "tokens", "create", "--kind", "ingest", "--deployment", LONG_DEPLOYMENT,
            "--name", LONG_TOKEN_NAME, "--by", LONG_PERSON)  # fmt: skip
    kvwatch(db, "silences", "create", "--match", f"deployment_id={LONG_DEPLOYMENT}",
            "--for", "2h", "--by", LONG_PERSON, "--comment", "load test")  # fmt: skip

    alerts = kvwatch(db, "alerts", "list").stdout
    assert_fits_80_uncut(alerts)
    col = columns(alerts)
    assert LONG_DEPLOYMENT in col["deployment"] and "stale_page_read" in col["rule"]
    # the columns a person triages with; the rest named, and --wide brings them
    assert "summary" not in col and "--wide" in alerts, alerts
    assert "stale_page_read" in ANSI.sub("", alerts)  # a rule's name is never broken
    wide = kvwatch(db, "alerts", "list", "--wide").stdout
    assert "summary" in columns(wide) and "--wide" not in wide

    tokens = kvwatch(db, "tokens", "list").stdout
    assert_fits_80_uncut(tokens)
    col = columns(tokens)
    assert f"deployment={LONG_DEPLOYMENT}" in col["scope"] and LONG_TOKEN_NAME in col["name"]

    silences = kvwatch(db, "silences", "list").stdout
    assert_fits_80_uncut(silences)
    col = columns(silences)
    assert f"deployment_id={LONG_DEPLOYMENT}" in col["matchers"] and LONG_PERSON in col["by"]

    incidents = kvwatch(db, "incidents", "list").stdout
    assert_fits_80_uncut(incidents)
    assert LONG_DEPLOYMENT in columns(incidents)["deployment"]

    rules = kvwatch(db, "policies", "list").stdout
    assert_fits_80_uncut(rules)
    assert "rejected_prefill_kv_transfer" in columns(rules)["rule"]


def test_ages_and_time_left_read_one_way(collector: Any) -> None:
    db = collector.db_url
    _stale_read(collector, 409)
    with collector.client(collector.admin) as c:  # the admin token is used: 'last used'
        assert c.get("/v1/alerts").status_code == 200

    with collector.client(collector.admin) as c:
        (alert,) = c.get("/v1/alerts").json()
    started = datetime.fromisoformat(alert["starts_at"])
    before = human_duration((datetime.now(UTC) - started).total_seconds())
    col = columns(kvwatch(db, "alerts", "list").stdout)
    after = human_duration((datetime.now(UTC) - started).total_seconds())
    assert col["started"] in {f"{before}ago".replace(" ", ""), f"{after}ago".replace(" ", "")}

    kvwatch(db, "tokens", "create", "--kind", "read", "--name", "quarterly", "--expires-in", "90d")
    col = columns(kvwatch(db, "tokens", "list").stdout)
    assert "in89d23h" in col["expires"], col  # the new token: 90 days less a few seconds
    col = columns(kvwatch(db, "tokens", "list", "--wide").stdout)
    assert re.search(r"\d+sago", col["lastused"]), col  # the admin token, just now
    assert "never" in col["lastused"]  # the new one

    r = kvwatch(db, "tokens", "revoke", "quarterly")
    assert "collectors refuse it within 5s" in " ".join(r.stderr.split()), r.stderr

    r = kvwatch(db, "silences", "create", "--match", "rule=stale_page_read", "--for", "2h",
                "--by", "dana", "--comment", "load test")  # fmt: skip
    assert "for 2h" in " ".join(r.stderr.split()), r.stderr
    col = columns(kvwatch(db, "silences", "list").stdout)
    assert "(in1h59m" in col["ends"], col


def test_an_expired_silence_shows_when_it_ended_and_that_it_was_expired(collector: Any) -> None:
    db = collector.db_url
    created = kvwatch(db, "silences", "create", "--match", "rule=stale_page_read",
                      "--for", "2h", "--by", "dana", "--comment", "load test")  # fmt: skip
    sid = created.stdout.strip()
    planned = datetime.now(UTC) + timedelta(hours=2)
    kvwatch(db, "silences", "expire", sid, "--by", "lee")
    with collector.client(collector.admin) as c:
        (doc,) = c.get("/v1/silences").json()
    # The API and the CLI read one document: its end is when the silence really ended.
    assert doc["active"] is False and doc["ends_at"] == doc["expired_at"]
    ended = datetime.fromisoformat(doc["ends_at"])
    assert abs(ended - datetime.now(UTC)) < timedelta(minutes=1)

    col = columns(kvwatch(db, "silences", "list").stdout)
    assert col["state"] == "expired", col
    assert ended.replace(microsecond=0).isoformat().replace("+00:00", "Z") in col["ends"], col
    assert planned.strftime("%Y-%m-%dT%H") not in col["ends"], col
    assert re.search(r"\(\d+sago\)", col["ends"]), col
    # Expiring it again changes nothing, and says so (exit 0).
    again = kvwatch(db, "silences", "expire", sid, "--by", "kim")
    assert "already expired" in again.stderr and "nothing changed" in again.stderr, again.stderr


def test_a_listing_at_80_columns_is_a_line_or_two_a_row(collector: Any) -> None:
    """Many alerts of long rules and summaries: at 80 columns each row stays short (the
    narrow columns, words never split), where every column squeezed into 80 took a dozen."""
    with collector.client(collector.ingest) as c:
        ts = datetime.now(UTC)
        events = [f.stale_read(i, dep=f"deployment-{i}", ts=ts) for i in range(1, 13)]
        assert c.post("/v1/events", json=[f.as_json(e) for e in events]).status_code == 200
    out = ANSI.sub("", kvwatch(collector.db_url, "alerts", "list").stdout)
    assert_fits_80_uncut(out)
    rows = [ln for ln in out.splitlines() if ln.startswith("│")]
    assert 12 <= len(rows) <= 24, out


@pytest.mark.parametrize(
    ("args", "allowed"),
    [
        (["alerts", "list", "--state", "fiiring"], "'pending', 'firing', 'resolved'"),
        (["alerts", "list", "--severity", "high"], "'info', 'warning', 'critical'"),
        (["incidents", "list", "--state", "opened"], "'open', 'closed'"),
        (["tokens", "create", "--kind", "root"], "'ingest', 'read', 'admin'"),
    ],
)
def test_a_value_outside_an_options_choices_exits_2_naming_them(
    db_url: str, args: list[str], allowed: str
) -> None:
    r = CliRunner().invoke(app, args, env={"COLUMNS": "200", "KVWATCH_DATABASE_URL": db_url})
    assert r.exit_code == 2, r.output
    assert allowed in " ".join(r.output.split()), r.output
