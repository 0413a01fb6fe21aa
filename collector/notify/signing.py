"""Standard Webhooks signing (https://www.standardwebhooks.com), symmetric scheme ``v1``.

A secret is ``whsec_`` + base64 of random bytes; the HMAC key is the decoded bytes, not the
text. The signed content is ``{webhook-id}.{webhook-timestamp}.{raw body}`` and the header is a
space-separated list of ``v1,<base64 HMAC-SHA256>`` entries (several during secret rotation).

``verify`` is the function receivers call; it only needs the standard library and
``collector.errors``, so it can be vendored or imported on its own.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import time
from collections.abc import Mapping, Sequence

from collector.errors import InvalidInput, Unauthorized

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32  # the spec asks for 24 to 64 random bytes
DEFAULT_TOLERANCE_S = 300
HEADER_ID = "webhook-id"
HEADER_TIMESTAMP = "webhook-timestamp"
HEADER_SIGNATURE = "webhook-signature"


class WebhookVerificationError(Unauthorized):
    """The request is not an authentic, fresh webhook. A receiver answers 401 and drops it."""

    code = "webhook_verification_failed"


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def secret_key(secret: str) -> bytes:
    """The HMAC key of a ``whsec_`` secret. A bare base64 secret is accepted too, as the
    Standard Webhooks libraries do."""
    encoded = secret.removeprefix(SECRET_PREFIX)
    try:
        key = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(
            "secret must be 'whsec_' followed by base64", {"field": "secret"}
        ) from None
    if not key:
        raise InvalidInput("secret is empty", {"field": "secret"})
    return key


def _signature(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return base64.b64encode(mac.digest()).decode()


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value for one attempt: ``v1,<base64 HMAC-SHA256>``."""
    if "." in msg_id:
        # A dot would let the id and timestamp boundaries shift inside the signed content.
        raise ValueError("a webhook id must not contain '.'")
    return "v1," + _signature(secret_key(secret), msg_id, int(timestamp), body)


def sign_all(secrets: Sequence[str], msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value signed with each of ``secrets`` (a rotation's new
    secret and, during its grace, the previous one): space-separated ``v1,`` entries, any of
    which a receiver may match."""
    return " ".join(sign(secret, msg_id, timestamp, body) for secret in secrets)


def verify(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    now: float | None = None,
) -> None:
    """Check that ``body`` with these headers was signed with ``secret`` within
    ``tolerance_s`` of ``now``; raise ``WebhookVerificationError`` saying what is wrong.

    ``body`` must be the raw bytes received: re-serialised JSON will not match. After this
    passes, use ``webhook-id`` as an idempotency key: a sender retries under the same id.
    """
    key = secret_key(secret)
    # HTTP header names are case-insensitive; a plain dict from a framework may not be.
    lower = {k.lower(): v for k, v in headers.items()}
    missing = [h for h in (HEADER_ID, HEADER_TIMESTAMP, HEADER_SIGNATURE) if not lower.get(h)]
    if missing:
        raise WebhookVerificationError(f"missing header(s): {', '.join(missing)}")
    msg_id, ts_text, sig_header = lower[HEADER_ID], lower[HEADER_TIMESTAMP], lower[HEADER_SIGNATURE]
    if not ts_text.strip().isdigit():
        raise WebhookVerificationError(f"{HEADER_TIMESTAMP} is not an integer: {ts_text!r}")
    timestamp = int(ts_text)
    current = time.time() if now is None else now
    if timestamp < current - tolerance_s:
        raise WebhookVerificationError(
            f"{HEADER_TIMESTAMP} too old: {current - timestamp:.0f}s ago "
            f"(tolerance {tolerance_s:g}s); a replay or a badly skewed clock"
        )
    if timestamp > current + tolerance_s:
        raise WebhookVerificationError(
            f"{HEADER_TIMESTAMP} too new: {timestamp - current:.0f}s in the future "
            f"(tolerance {tolerance_s:g}s)"
        )
    expected = _signature(key, msg_id, timestamp, body).encode()
    candidates = 0
    for entry in sig_header.split():
        version, _, value = entry.partition(",")
        if version != "v1":
            continue  # v1a (asymmetric) and future schemes are not ours to check
        candidates += 1
        # Constant time: a comparison that stops at the first differing byte would let a
        # caller learn the expected signature byte by byte.
        if hmac.compare_digest(expected, value.encode()):
            return
    if candidates == 0:
        raise WebhookVerificationError(f"{HEADER_SIGNATURE} holds no v1 signature")
    raise WebhookVerificationError(
        f"no matching signature ({candidates} v1 signature(s) checked): wrong secret, "
        "or the body, id or timestamp changed in transit"
    )
