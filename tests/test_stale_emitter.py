"""The stale-read emitter the three engine adapters share: dedupe, chunking, tenant names."""

from __future__ import annotations

from typing import Any

from engine_probe.adapters.common import UNKNOWN, StaleReadEmitter
from engine_probe.events import MAX_PAGE_IDS, PageStaleRead
from engine_probe.ledger import UNKNOWN_TENANT, StaleRead

NAMES = {1: ("req-a", "acme"), 2: ("req-b", "globex")}
TENANTS = {10: "acme", 20: "globex"}


def _emitter() -> tuple[StaleReadEmitter, list[dict[str, Any]], dict[str, int]]:
    sent: list[dict[str, Any]] = []
    counters = {"stale_reads": 0}

    def emit(kind: type, **fields: Any) -> None:
        assert kind is PageStaleRead
        sent.append(fields)

    def names(h: int) -> tuple[str, str]:
        return NAMES.get(h, (f"handle-{h}", UNKNOWN))

    return StaleReadEmitter(emit, counters, names, TENANTS.get), sent, counters


def _read(pages: list[int], *, reader: int = 2, prev: int | None = 1, **kw: Any) -> StaleRead:
    fields: dict[str, Any] = {
        "reader_request": reader,
        "reader_tenant": 20,
        "page_ids": pages,
        "previous_request": prev,
        "previous_tenant": None if prev is None else 10,
        "zeroized": False,
        "read_kind": "decode",
        "pool": "prefill",
    }
    fields.update(kw)
    return StaleRead(**fields)


def test_a_decode_read_is_reported_once_per_page_and_writer_until_forgotten() -> None:
    em, sent, counters = _emitter()
    em.report([_read([3, 4, 4])], node="n0", role="both", dedupe=True)
    em.report([_read([3, 4, 5])], node="n0", role="both", dedupe=True)
    assert [e["page_ids"] for e in sent] == [[3, 4], [5]]
    assert counters["stale_reads"] == 2
    # the same page of another pool is another exposure
    em.report([_read([3], pool="decode")], node="n1", role="decode", dedupe=True)
    assert len(sent) == 3
    em.forget(2)
    em.report([_read([3])], node="n0", role="both", dedupe=True)
    assert len(sent) == 4


def test_a_transfer_is_reported_every_time() -> None:
    em, sent, _ = _emitter()
    for _ in range(2):
        em.report([_read([7], read_kind="transfer")], node="p", role="prefill", dedupe=False)
    assert [e["read_kind"] for e in sent] == ["transfer", "transfer"]


def test_names_come_from_the_ledger_and_an_unknown_writer_stays_unknown() -> None:
    em, sent, _ = _emitter()
    em.report([_read([1])], node="n0", role="both", dedupe=True)
    first = sent[-1]
    assert (first["reader_request_id"], first["reader_tenant"]) == ("req-b", "globex")
    assert (first["previous_request_id"], first["previous_tenant"]) == ("req-a", "acme")
    # the ledger does not know who wrote it: "unknown" (another tenant to the rules), even
    # though the adapter has a record of the request: a stale read must never be taken for
    # a same-tenant one on a guess
    em.report([_read([2], previous_tenant=UNKNOWN_TENANT)], node="n0", role="both", dedupe=True)
    assert sent[-1]["previous_tenant"] == UNKNOWN
    # a ledger tenant the adapter can no longer name: its record of the writing request
    em.report([_read([3], previous_tenant=77)], node="n0", role="both", dedupe=True)
    assert sent[-1]["previous_tenant"] == "acme"
    # neither knows: "unknown", never dropped
    em.report([_read([4], prev=99, previous_tenant=77)], node="n0", role="both", dedupe=True)
    assert (sent[-1]["previous_request_id"], sent[-1]["previous_tenant"]) == (
        "handle-99",
        UNKNOWN,
    )
    # never written: no previous writer at all
    em.report([_read([5], prev=None)], node="n0", role="both", dedupe=True)
    assert (sent[-1]["previous_request_id"], sent[-1]["previous_tenant"]) == (None, None)
    # a reader the adapter has no record of: named by the ledger's tenant
    em.report([_read([6], reader=5, reader_tenant=20)], node="n0", role="both", dedupe=True)
    assert (sent[-1]["reader_request_id"], sent[-1]["reader_tenant"]) == ("handle-5", "globex")


def test_an_explicit_reader_names_the_request_that_read() -> None:
    """A granted (prefix-cache) read is checked as its computing request's; the request
    that read it is the one reported, by the names the adapter passes, and the one its
    dedupe state belongs to."""
    em, sent, _ = _emitter()
    reader = (2, "req-live", "globex")  # names from the live request, not a bounded cache
    em.report([_read([5], reader=1)], node="n0", role="both", dedupe=True, reader=reader)
    assert (sent[-1]["reader_request_id"], sent[-1]["reader_tenant"]) == ("req-live", "globex")
    em.forget(1)  # not the reader: its state is kept
    em.report([_read([5], reader=1)], node="n0", role="both", dedupe=True, reader=reader)
    assert len(sent) == 1


def test_long_reads_are_cut_to_the_wire_limit() -> None:
    em, sent, counters = _emitter()
    em.report([_read(list(range(MAX_PAGE_IDS + 3)))], node="n0", role="both", dedupe=False)
    assert [len(e["page_ids"]) for e in sent] == [MAX_PAGE_IDS, 3]
    assert counters["stale_reads"] == 1
