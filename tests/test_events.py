"""The wire contract: every kind round-trips; bad input is named precisely, never crashes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_probe import events as ev
from tests import factories as f

ALL = [
    f.config(1),
    f.admitted(2, "r1"),
    f.rejected(3, "r2"),
    f.finished(4, "r1"),
    f.pool(5),
    ev.KvTransfer(
        **f.base(6),
        request_id="r1",
        tenant="acme",
        from_node="p0",
        to_node="d0",
        pages=3,
        tokens=150,
        prefill_rejected=True,
    ),
    ev.PageReuse(**f.base(7), step=9, reused_pages=4, cross_tenant_pages=2),
    f.stale_read(8),
    ev.CanaryHit(
        **f.base(9),
        detector="paint",
        reader_request_id="r1",
        reader_tenant="acme",
        canary_tenant="globex",
        page_ids=[1],
    ),
    ev.ProbeDrops(**f.base(10), counts={"buffer_full": 3}),
    ev.ProbeStopped(**f.base(11)),
    f.prefix_hit(11),
    ev.KvTurnover(
        **f.base(11),
        interval_s=10.0,
        stored_blocks=5,
        removed_blocks=2,
        unsalted_blocks=3,
        salted_blocks=1,
        restored_blocks=2,
        cross_session_blocks=1,
    ),
    ev.SourceGap(
        **f.base(11),
        source="kv_events",
        interval_s=10.0,
        silent_s=95.5,
        cause="engine_served",
        requests=12,
        reason="no KV event from tcp://vllm-0:5557 in 95 s while the engine served 12 requests",
    ),
    *f.parallel_sampling(12, "cmpl-1", 2),  # the second names the first's prompt
]


def test_every_kind_round_trips() -> None:
    assert {ev.kind_of(e) for e in ALL} == set(ev.KINDS)
    body = ev.encode_batch(ALL)
    assert ev.decode_json_batch(body) == ALL
    ndjson = b"\n".join(ev.encode_event(e) for e in ALL)
    assert ev.decode_ndjson_batch(ndjson) == ALL
    for e in ALL:
        assert json.loads(ev.encode_event(e))["kind"] == ev.kind_of(e)


def test_no_event_carries_text() -> None:
    for t in ev.EVENT_TYPES:
        fields = set(t.__struct_fields__)
        assert not fields & {"prompt", "completion", "text", "messages", "content"}, t


@pytest.mark.parametrize(
    ("patch", "field", "fragment"),
    [
        ({"seq": 0}, "seq", ">= 1"),
        ({"seq": -5}, "seq", ">= 1"),
        ({"schema_version": 2}, "schema_version", "Invalid enum value 2"),
        ({"ts": "2026-08-27T12:00:00"}, "ts", "timezone"),
        ({"probe_id": ""}, "probe_id", "length >= 1"),
        ({"probe_id": "x" * 129}, "probe_id", "length <= 128"),
        ({"probe_id": "bad id with spaces"}, "probe_id", "not a valid id"),
        ({"data_categories": ["ok", "no spaces"]}, "data_categories[1]", "not a valid category"),
        ({"tenant": "acme\n"}, "tenant", "not a valid id"),
        ({"tenant": None}, "tenant", "got `null`"),
        ({"prompt_tokens": 2**41}, "prompt_tokens", "<= "),
        ({"prompt_tokens": 1.5}, "prompt_tokens", "Expected `int | null`"),
        ({"data_categories": ["ok"] * 17}, "data_categories", "length <= 16"),
        ({"completion": "leak"}, "completion", "unknown field"),
        ({"prompt_shared_with": "r1"}, "prompt_shared_with", "names the request itself"),
        ({"prompt_shared_with": "no spaces"}, "prompt_shared_with", "not a valid id"),
        ({"prompt_shared_with": ""}, "prompt_shared_with", "length >= 1"),
    ],
)
def test_field_errors_name_the_field(patch: dict[str, object], field: str, fragment: str) -> None:
    good = f.as_json(f.admitted(1, "r1"))
    body = json.dumps([good, good | patch], default=str).encode()
    with pytest.raises(ev.DecodeError) as info:
        ev.decode_json_batch(body)
    (err,) = info.value.errors
    assert (err.index, err.field) == (1, field)
    assert fragment in err.message


def test_prompt_shared_with_is_an_optional_addition() -> None:
    """Events from producers that predate the field decode as before (it is None); one that
    sets it round-trips; a producer building a request that names itself fails at once."""
    old = f.as_json(f.admitted(1, "0_cmpl-1"))
    del old["prompt_shared_with"]
    (e,) = ev.decode_json_batch(json.dumps([old], default=str).encode())
    assert isinstance(e, ev.RequestAdmitted) and e.prompt_shared_with is None
    child = f.parallel_sampling(2, "cmpl-1", 2)[1]
    assert isinstance(child, ev.RequestAdmitted) and child.prompt_shared_with == "0_cmpl-1"
    assert ev.decode_event(ev.encode_event(child)) == child
    with pytest.raises(ValueError, match="prompt_shared_with: names the request itself"):
        f.admitted(3, "0_cmpl-1", prompt_shared_with="0_cmpl-1")


def test_batch_limit() -> None:
    body = ev.encode_batch([f.pool(i) for i in range(1, 12)])
    with pytest.raises(ev.BatchTooLarge):
        ev.decode_json_batch(body, max_events=10)
    with pytest.raises(ev.BatchTooLarge):
        ev.decode_ndjson_batch(b"{}\n" * 11, max_events=10)


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_fail_cleanly(data: bytes) -> None:
    try:
        ev.decode_json_batch(data)
        ev.decode_ndjson_batch(data)
    except (ev.DecodeError, ev.BatchTooLarge):
        pass


@settings(max_examples=300, deadline=None)
@given(st.lists(_json_values, max_size=5))
def test_arbitrary_json_fails_cleanly(items: list[object]) -> None:
    body = json.dumps(items).encode()
    try:
        out = ev.decode_json_batch(body)
    except ev.DecodeError as exc:
        assert exc.errors and all(e.index is None or 0 <= e.index < len(items) for e in exc.errors)
    else:
        assert out == [] and items == []


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(ALL),
    st.sampled_from(["seq", "ts", "probe_id", "deployment_id", "kind"]),
    _json_values,
)
def test_mutated_events_are_rejected_or_valid(event: ev.Event, key: str, value: object) -> None:
    doc = f.as_json(event) | {key: value}
    try:
        (out,) = ev.decode_json_batch(json.dumps([doc]).encode())
    except ev.DecodeError as exc:
        assert exc.errors[0].index == 0
    else:
        assert ev.kind_of(out) == doc["kind"]
