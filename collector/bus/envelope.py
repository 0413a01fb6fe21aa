"""What one message on the bus carries: the batch's body exactly as the collector received
and validated it, and the facts the collector decided before publishing (who sent it, when
it was received, how it is encoded). A writer stores it as the collector would have, under
that principal and that time: the token's later revocation, or the clock when the writer gets
to it, change nothing about a batch the collector already accepted.

Only what a probe sends travels: token counts, ids, page events; never a prompt or
completion (the collector never receives any)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from collector.errors import InvalidInput
from collector.store import micros
from collector.tokens import Principal

Kind = Literal["events", "traces"]

_KIND = "Kvwatch-Kind"
_PRINCIPAL = "Kvwatch-Principal"
_RECEIVED = "Kvwatch-Received-Us"
_CTYPE = "Content-Type"
_ENCODING = "Content-Encoding"
MSG_ID = "Nats-Msg-Id"  # JetStream's de-duplication header


class EnvelopeError(InvalidInput):
    """A message that is not a kvwatch batch (a header missing or malformed): refused for
    good, as a malformed batch is at ingest."""


@dataclass(frozen=True, slots=True)
class Envelope:
    kind: Kind
    principal: Principal
    received: datetime
    content_type: str
    content_encoding: str
    msg_id: str

    def headers(self) -> dict[str, str]:
        return {
            _KIND: self.kind,
            _PRINCIPAL: json.dumps(self.principal.token_fields(), separators=(",", ":")),
            _RECEIVED: str(micros(self.received)),
            _CTYPE: self.content_type,
            _ENCODING: self.content_encoding,
            MSG_ID: self.msg_id,
        }

    @classmethod
    def from_headers(cls, headers: dict[str, str] | None) -> Envelope:
        h = headers or {}
        try:
            kind = h[_KIND]
            if kind not in ("events", "traces"):
                raise EnvelopeError(f"{_KIND} {kind!r} is neither events nor traces")
            principal = Principal(**json.loads(h[_PRINCIPAL]))
            received = datetime.fromtimestamp(int(h[_RECEIVED]) / 1e6, UTC)
            return cls(
                kind=kind,  # type: ignore[arg-type]
                principal=principal,
                received=received,
                content_type=h.get(_CTYPE, ""),
                content_encoding=h.get(_ENCODING, ""),
                msg_id=h.get(MSG_ID, ""),
            )
        except EnvelopeError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise EnvelopeError(f"not a kvwatch batch: {type(exc).__name__}: {exc}") from None


def events_msg_id(probe_id: str, first_seq: int, last_seq: int, count: int) -> str:
    """A probe's batch is its seq range: a retry of it (the answer lost, the collector killed
    after publishing) carries the same id, and the stream drops it within its de-duplication
    window; after it, the store drops it as duplicates."""
    return f"ev:{probe_id}:{first_seq}-{last_seq}:{count}"


def traces_msg_id(lineage: int, body: bytes) -> str:
    """Spans carry no seq: an exporter's retry is the same body under the same token."""
    return f"otlp:{lineage}:{hashlib.sha256(body).hexdigest()[:40]}"
