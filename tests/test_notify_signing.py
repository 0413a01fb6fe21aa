"""Standard Webhooks signing: the spec's formula, its published vector, and every rejection."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from collector.errors import InvalidInput
from collector.notify.signing import WebhookVerificationError, new_secret, sign, verify
from kvwatch.cli import app

NOW = 1_700_000_000
BODY = b'{"type":"alert.firing","version":1}'
Change = Callable[[dict[str, str], bytes], tuple[dict[str, str], bytes]]


def _headers(
    secret: str, msg_id: str = "msg_abc", ts: int = NOW, body: bytes = BODY
) -> dict[str, str]:
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(ts),
        "webhook-signature": sign(secret, msg_id, ts, body),
    }


def test_new_secret_is_whsec_and_32_random_bytes() -> None:
    a, b = new_secret(), new_secret()
    assert a.startswith("whsec_") and a != b
    assert len(base64.b64decode(a.removeprefix("whsec_"), validate=True)) == 32


def test_signature_is_the_spec_formula_computed_independently() -> None:
    key = bytes(range(32))
    secret = "whsec_" + base64.b64encode(key).decode()
    mac = hmac.new(key, b"msg_2KWPBgLlAfxdpx2AI54pPJ85f4W.1674087231." + BODY, hashlib.sha256)
    expected = "v1," + base64.b64encode(mac.digest()).decode()
    assert sign(secret, "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W", 1674087231, BODY) == expected


def test_the_published_standard_webhooks_vector() -> None:
    # The vector the Standard Webhooks / Svix libraries test against: matching it means any
    # of those libraries verifies our deliveries.
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    body = b'{"test": 2432232314}'
    sig = sign(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body)
    assert sig == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    headers = {
        "webhook-id": "msg_p5jXN8AQM9LWM0D4loKWxJek",
        "webhook-timestamp": "1614265330",
        "webhook-signature": sig,
    }
    verify(secret, headers, body, now=1614265330)


def test_round_trip_with_any_header_case_and_a_rotated_secret_first() -> None:
    secret, old = new_secret(), new_secret()
    headers = _headers(secret)
    verify(secret, headers, BODY, now=NOW)
    verify(secret, {k.title(): v for k, v in headers.items()}, BODY, now=NOW + 299)
    # Several signatures (secret rotation): one match is enough, in any position.
    rotated = dict(headers)
    rotated["webhook-signature"] = (
        sign(old, "msg_abc", NOW, BODY) + " v1a,bm90IG91cnM= " + headers["webhook-signature"]
    )
    verify(secret, rotated, BODY, now=NOW)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda h, b: (h, b + b" "), "no matching signature"),
        (lambda h, b: ({**h, "webhook-id": "msg_other"}, b), "no matching signature"),
        (lambda h, b: ({**h, "webhook-timestamp": str(NOW - 1)}, b), "no matching signature"),
        (lambda h, b: ({**h, "webhook-signature": "v1a,abc"}, b), "no v1 signature"),
        (lambda h, b: ({**h, "webhook-timestamp": "soon"}, b), "not an integer"),
        (lambda h, b: ({k: v for k, v in h.items() if k != "webhook-id"}, b), "webhook-id"),
        (lambda h, b: ({}, b), "missing header(s): webhook-id, webhook-timestamp"),
    ],
    ids=["tampered-body", "other-id", "other-timestamp", "v1a-only", "bad-ts", "no-id", "none"],
)
def test_rejections_say_what_is_wrong(change: Change, reason: str) -> None:
    secret = new_secret()
    headers, body = change(_headers(secret), BODY)
    with pytest.raises(WebhookVerificationError, match=re.escape(reason)):
        verify(secret, headers, body, now=NOW)


def test_wrong_secret_is_rejected() -> None:
    with pytest.raises(WebhookVerificationError, match="no matching signature"):
        verify(new_secret(), _headers(new_secret()), BODY, now=NOW)


def test_stale_and_future_timestamps_are_rejected() -> None:
    secret = new_secret()
    with pytest.raises(WebhookVerificationError, match="too old"):
        verify(secret, _headers(secret), BODY, now=NOW + 301)
    with pytest.raises(WebhookVerificationError, match="too new"):
        verify(secret, _headers(secret), BODY, now=NOW - 301)
    verify(secret, _headers(secret), BODY, now=NOW + 3000, tolerance_s=3600)


def test_a_malformed_secret_is_a_usage_error_not_a_verification_failure() -> None:
    with pytest.raises(InvalidInput, match="whsec_"):
        verify("whsec_***", _headers(new_secret()), BODY, now=NOW)
    with pytest.raises(ValueError, match="must not contain"):
        sign(new_secret(), "msg.with.dots", NOW, BODY)


def test_cli_verify_exit_codes(tmp_path: Path) -> None:
    secret = new_secret()
    body_file = tmp_path / "body.json"
    body_file.write_bytes(BODY)
    ts = int(time.time())
    good = sign(secret, "msg_cli", ts, BODY)
    args = ["webhooks", "verify", "--secret", secret, "--body-file", str(body_file)]
    args += ["--id", "msg_cli", "--timestamp", str(ts)]
    runner = CliRunner()

    ok = runner.invoke(app, [*args, "--signature", good])
    assert ok.exit_code == 0, ok.output
    bad = runner.invoke(app, [*args, "--signature", sign(new_secret(), "msg_cli", ts, BODY)])
    assert bad.exit_code == 1
    assert "no matching signature" in bad.stderr
    body_file.write_bytes(BODY + b"\n")
    tampered = runner.invoke(app, [*args, "--signature", good])
    assert tampered.exit_code == 1 and "no matching signature" in tampered.stderr
    stale = runner.invoke(
        app,
        [*args[:-1], str(ts - 600), "--signature", sign(secret, "msg_cli", ts - 600, BODY + b"\n")],
    )
    assert stale.exit_code == 1 and "too old" in stale.stderr
    lenient = runner.invoke(
        app,
        [
            *args[:-1],
            str(ts - 600),
            "--signature",
            sign(secret, "msg_cli", ts - 600, BODY + b"\n"),
            "--tolerance",
            "900",
        ],
    )
    assert lenient.exit_code == 0, lenient.stderr


def test_cli_verify_as_a_real_process(tmp_path: Path) -> None:
    secret = new_secret()
    body_file = tmp_path / "body.json"
    body_file.write_bytes(BODY)
    ts = int(time.time())
    base = [sys.executable, "-m", "kvwatch.cli", "webhooks", "verify", "--secret", secret]
    base += ["--body-file", str(body_file), "--id", "msg_p", "--timestamp", str(ts)]
    ok = subprocess.run(
        [*base, "--signature", sign(secret, "msg_p", ts, BODY)],
        text=True,
        capture_output=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(
        [*base, "--signature", "v1,AAAA"], text=True, capture_output=True, timeout=120
    )
    assert bad.returncode == 1 and "no matching signature" in bad.stderr
