"""OTLP/HTTP's wire: an export request's body → :class:`Span` views, and the answer.

Both encodings OTLP/HTTP allows end in the same shape, so nothing after this module knows
which one a client sent:

- ``application/x-protobuf``: ``ExportTraceServiceRequest``, parsed by the protobuf classes
  ``opentelemetry-proto`` ships (the OpenTelemetry project's own, generated from the .proto
  files; protobuf's C parser does the work);
- ``application/json``: OTLP's JSON mapping (lowerCamelCase keys, trace and span ids in hex,
  64-bit integers as strings or numbers, enums as integers), decoded by msgspec into typed
  structs in one C pass. protobuf's ``json_format`` would read ids as base64, which OTLP's
  JSON is not, and is several times slower.

``Content-Encoding: gzip`` is inflated here, under the same byte limit as the body, so a
small compressed body cannot expand past it. Every refusal names what was wrong: 400 for a
body that is not an export request, 413 over the limits, 415 for another content type or
encoding.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import msgspec
from google.protobuf.message import DecodeError as ProtobufDecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from collector.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType

PROTOBUF: Final = "application/x-protobuf"
JSON: Final = "application/json"
CONTENT_TYPES: Final = (PROTOBUF, JSON)
STATUS_ERROR: Final = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR


@dataclass(frozen=True, slots=True)
class Span:
    """One span, as the GenAI mapping reads it. ``attrs`` are the span's own attributes,
    ``resource`` its resource's (one dict shared by the resource's spans), each holding only
    the keys the decoder was told to keep (values are str, bool, int, float, bytes, lists
    and dicts of them, or None): every other attribute, a prompt's or completion's text
    among them, is never even converted. ``genai``: the span has an attribute of its own
    named ``gen_ai.*``. Ids are lowercase hex ('' when the span has none)."""

    trace_id: str
    span_id: str
    name: str
    start_ns: int
    end_ns: int
    error: bool
    status_message: str
    attrs: dict[str, Any]
    resource: dict[str, Any]
    genai: bool


def media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def inflate(body: bytes, content_encoding: str, limit: int) -> bytes:
    """The body as sent before ``Content-Encoding`` (gzip, or none), at most ``limit``
    bytes once inflated."""
    enc = content_encoding.strip().lower()
    if enc in ("", "identity"):
        return body
    if enc != "gzip":
        raise UnsupportedMediaType(
            f"Content-Encoding {content_encoding!r} is not accepted; send gzip or none"
        )
    # A gzip stream may hold several members (RFC 1952 2.2), read as one body: each is
    # inflated in turn, the limit counting them all, and none is dropped.
    out = b""
    rest = body
    while True:
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        try:
            out += inflater.decompress(rest, limit + 1 - len(out))
        except zlib.error as exc:
            raise BadRequest(f"the body is not valid gzip: {exc}") from None
        if len(out) > limit:
            raise PayloadTooLarge(
                f"the body inflates past the limit of {limit} bytes", {"limit_bytes": limit}
            )
        if not inflater.eof:
            raise BadRequest("the gzip body is truncated")
        rest = inflater.unused_data
        if not rest:
            return out


def decode(body: bytes, content_type: str, max_spans: int, keep: frozenset[str]) -> list[Span]:
    """Every span of an export request, in order, keeping the attributes named in ``keep``.
    ``max_spans``: more is a 413."""
    mime = media_type(content_type)
    if mime == PROTOBUF:
        spans = list(_from_protobuf(body, keep))
    elif mime == JSON:
        spans = list(_from_json(body, keep))
    else:
        raise UnsupportedMediaType(
            f"Content-Type {mime!r} is not accepted on /v1/traces; send {PROTOBUF} or {JSON} "
            "(OTLP/HTTP)"
        )
    if len(spans) > max_spans:
        raise PayloadTooLarge(
            f"the export request holds {len(spans)} spans; the limit is {max_spans}",
            {"limit_spans": max_spans},
        )
    return spans


def encode_response(mime: str, rejected: int, message: str) -> bytes:
    """``ExportTraceServiceResponse`` in the request's encoding. Its ``partial_success`` is
    set only when a span was rejected or there is a warning; a full success is empty."""
    if mime == PROTOBUF:
        resp = ExportTraceServiceResponse()
        if rejected or message:
            resp.partial_success.rejected_spans = rejected
            resp.partial_success.error_message = message
        return bytes(resp.SerializeToString())
    if not (rejected or message):
        return b"{}"
    # proto3 JSON writes 64-bit integers as strings
    partial = {"rejectedSpans": str(rejected), "errorMessage": message}
    return msgspec.json.encode({"partialSuccess": partial})


# -- protobuf ---------------------------------------------------------------------------------


def _from_protobuf(body: bytes, keep: frozenset[str]) -> Iterator[Span]:
    req = ExportTraceServiceRequest()
    try:
        req.ParseFromString(body)
    except (ProtobufDecodeError, RecursionError) as exc:
        raise BadRequest(f"the body is not an OTLP ExportTraceServiceRequest: {exc}") from None
    for rs in req.resource_spans:
        resource = {kv.key: _pb_value(kv.value) for kv in rs.resource.attributes if kv.key in keep}
        for ss in rs.scope_spans:
            for sp in ss.spans:
                attrs: dict[str, Any] = {}
                genai = False
                for kv in sp.attributes:
                    key = kv.key
                    if key in keep:
                        attrs[key] = _pb_value(kv.value)
                    if not genai and key.startswith("gen_ai."):
                        genai = True
                yield Span(
                    trace_id=sp.trace_id.hex(),
                    span_id=sp.span_id.hex(),
                    name=sp.name,
                    start_ns=sp.start_time_unix_nano,
                    end_ns=sp.end_time_unix_nano,
                    error=sp.status.code == STATUS_ERROR,
                    status_message=sp.status.message,
                    attrs=attrs,
                    resource=resource,
                    genai=genai,
                )


def _pb_value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_pb_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _pb_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind)


# -- JSON -------------------------------------------------------------------------------------


class _JValue(msgspec.Struct, rename="camel"):
    string_value: str | None = None
    bool_value: bool | None = None
    int_value: int | str | None = None
    double_value: float | str | None = None
    array_value: _JArray | None = None
    kvlist_value: _JKvList | None = None
    bytes_value: str | None = None


class _JArray(msgspec.Struct, rename="camel"):
    values: list[_JValue] = []


class _JKeyValue(msgspec.Struct, rename="camel"):
    key: str
    value: _JValue | None = None


class _JKvList(msgspec.Struct, rename="camel"):
    values: list[_JKeyValue] = []


class _JStatus(msgspec.Struct, rename="camel"):
    code: int | str = 0
    message: str = ""


class _JSpan(msgspec.Struct, rename="camel"):
    trace_id: str = ""
    span_id: str = ""
    name: str = ""
    start_time_unix_nano: int | str = 0
    end_time_unix_nano: int | str = 0
    attributes: list[_JKeyValue] = []
    status: _JStatus | None = None


class _JScopeSpans(msgspec.Struct, rename="camel"):
    spans: list[_JSpan] = []


class _JResource(msgspec.Struct, rename="camel"):
    attributes: list[_JKeyValue] = []


class _JResourceSpans(msgspec.Struct, rename="camel"):
    resource: _JResource | None = None
    scope_spans: list[_JScopeSpans] = []


class _JRequest(msgspec.Struct, rename="camel"):
    resource_spans: list[_JResourceSpans] = []


_json_request = msgspec.json.Decoder(_JRequest)


def _from_json(body: bytes, keep: frozenset[str]) -> Iterator[Span]:
    try:
        req = _json_request.decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"not an OTLP/JSON ExportTraceServiceRequest: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("JSON nested too deeply") from None
    for r, rs in enumerate(req.resource_spans):
        where = f"resourceSpans[{r}]"
        resource = (
            _j_attrs(rs.resource.attributes, f"{where}.resource", keep) if rs.resource else {}
        )
        for s, ss in enumerate(rs.scope_spans):
            for k, sp in enumerate(ss.spans):
                at = f"{where}.scopeSpans[{s}].spans[{k}]"
                status = sp.status or _JStatus()
                yield Span(
                    trace_id=_hex_id(sp.trace_id),
                    span_id=_hex_id(sp.span_id),
                    name=sp.name,
                    start_ns=_j_int(sp.start_time_unix_nano, f"{at}.startTimeUnixNano"),
                    end_ns=_j_int(sp.end_time_unix_nano, f"{at}.endTimeUnixNano"),
                    error=_j_int(status.code, f"{at}.status.code") == STATUS_ERROR,
                    status_message=status.message,
                    attrs=_j_attrs(sp.attributes, at, keep),
                    resource=resource,
                    genai=any(kv.key.startswith("gen_ai.") for kv in sp.attributes),
                )


def _hex_id(value: str) -> str:
    try:
        return bytes.fromhex(value).hex()  # C speed; lower case; '' for ''
    except ValueError:
        return ""


def _j_int(value: int | str, where: str) -> int:
    if isinstance(value, int):
        return value
    try:
        return int(value)
    except ValueError:
        raise BadRequest(f"{where}: {value!r} is not an integer") from None


def _j_attrs(kvs: list[_JKeyValue], where: str, keep: frozenset[str]) -> dict[str, Any]:
    return {
        kv.key: _j_value(kv.value, f"{where}.attributes[{kv.key!r}]")
        for kv in kvs
        if kv.key in keep
    }


def _j_value(v: _JValue | None, where: str) -> Any:
    if v is None:
        return None
    if v.string_value is not None:
        return v.string_value
    if v.int_value is not None:
        return _j_int(v.int_value, where)
    if v.bool_value is not None:
        return v.bool_value
    if v.double_value is not None:
        d = v.double_value
        if isinstance(d, str):
            try:
                return float(d)  # proto3 JSON spells NaN and the infinities as strings
            except ValueError:
                raise BadRequest(f"{where}: {d!r} is not a number") from None
        return d
    if v.array_value is not None:
        return [_j_value(x, where) for x in v.array_value.values]
    if v.kvlist_value is not None:
        return {kv.key: _j_value(kv.value, where) for kv in v.kvlist_value.values}
    if v.bytes_value is not None:
        return v.bytes_value
    return None
