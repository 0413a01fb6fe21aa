"""Every time a caller passes in is bounded at the boundary (issue 20, item 5): outside
1970-01-01 to 2200-01-01 UTC a query parameter or a body field is a 422 naming the field, and
the CLI exits 2 with a message, never a 500 or a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvwatch.cli import app as cli
from tests.conftest import Collector

FAR = ["0001-01-05T00:00:00Z", "1969-12-31T23:59:59Z", "2200-01-01T00:00:00Z", "9999-12-31"]

# Every GET that takes a time, with the parameters it needs besides.
GETS: list[tuple[str, dict[str, str]]] = [
    ("/v1/review", {}),
    ("/v1/requests", {}),
    ("/v1/pool-samples", {}),
    ("/v1/page-events", {}),
    ("/v1/inventory", {"model_id": "m", "since": "2026-01-01T00:00:00Z"}),
    ("/v1/stats/prompt-tokens", {}),
    ("/v1/stats/top-prompts", {}),
    ("/v1/stats/page-events", {}),
]


def _named(r: object, field: str) -> bool:
    doc = r.json()  # type: ignore[attr-defined]
    return doc["error"]["code"] == "invalid_input" and field in doc["error"]["message"]


@pytest.mark.parametrize("when", FAR)
def test_far_times_are_refused_naming_the_field(collector: Collector, when: str) -> None:
    with collector.client(collector.admin) as c:
        for path, extra in GETS:
            for field in ("since", "until"):
                query = {**extra, field: when}
                if path == "/v1/inventory" and field == "since":
                    query["until"] = "2026-02-01T00:00:00Z"
                elif path == "/v1/inventory":
                    query["since"] = "1970-01-02T00:00:00Z"
                r = c.get(path, params=query)
                assert r.status_code == 422 and _named(r, field), (path, field, r.text)
        bodies = [
            ("/v1/reports", {"kind": "review", "until": when}, "until"),
            ("/v1/reports", {"kind": "review", "since": when}, "since"),
            (
                "/v1/reports",
                {"kind": "breach", "model_id": "m", "since": when, "until": "2026-01-01"},
                "since",
            ),
            (
                "/v1/silences",
                {"matchers": [{"name": "a", "value": "b"}], "starts_at": when, "duration": "1h",
                 "comment": "far"},
                "starts_at",
            ),
            (
                "/v1/verifications",
                {"deployment_id": "d", "model_id": "m", "passed": True, "verified_at": when},
                "verified_at",
            ),
        ]  # fmt: skip
        for path, body, field in bodies:
            r = c.post(path, json=body)
            assert r.status_code == 422 and _named(r, field), (path, body, r.text)


def test_a_silence_too_long_to_end_in_range_is_refused(collector: Collector) -> None:
    with collector.client(collector.admin) as c:
        for duration in ("200000d", "99999999999d"):
            r = c.post(
                "/v1/silences",
                json={
                    "matchers": [{"name": "a", "value": "b"}],
                    "duration": duration,
                    "comment": "forever",
                },
            )
            assert r.status_code == 422 and _named(r, "duration"), r.text


@pytest.mark.parametrize(
    ("when", "far_for"),
    [
        ("0001-01-05T00:00:00Z", "99999999999d"),  # past what a datetime can hold
        ("9999-12-31", "200000d"),  # a silence ending in 2574
    ],
)
def test_the_cli_exits_2_on_far_times(tmp_path: Path, when: str, far_for: str) -> None:
    db = f"sqlite:///{tmp_path / 'kvwatch.db'}"
    silence = ["silences", "create", "--match", "alertname=x", "--for", far_for, "--by", "ops",
               "--comment", "forever"]  # fmt: skip
    for args in (
        ["report", "review", "--out", str(tmp_path), "--until", when],
        ["report", "breach", "--out", str(tmp_path), "--model", "m", "--since", when,
         "--until", "2026-01-01"],
        ["report", "inventory", "--model", "m", "--since", when, "--until", "2026-01-01"],
        silence,
    ):  # fmt: skip
        res = CliRunner().invoke(cli, [*args, "--database-url", db])
        assert res.exit_code == 2, (args, res.output)
        assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
        assert "Traceback" not in res.output and "range" in res.output, res.output
    assert "--for" in res.output  # the silence's message names its flag
    listed = CliRunner().invoke(cli, ["silences", "list", "--database-url", db])
    assert listed.exit_code == 0 and "forever" not in listed.output, listed.output
