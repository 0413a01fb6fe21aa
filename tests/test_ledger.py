"""The page ledger: unit tests per operation and per stale-read case, then property-based tests
against a plain-Python reference model (zero false negatives, zero false positives)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine_probe.ledger import PageLedger, ReuseStats, StaleRead  # noqa: E402

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA is not available")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def ids(*pages: int, device: str = "cpu") -> torch.Tensor:
    return torch.tensor(pages, dtype=torch.long, device=device)


# --------------------------------------------------------------------------- unit tests


def test_fresh_ledger() -> None:
    led = PageLedger(8, name="prefill")
    assert led.num_pages == 8
    assert led.owner_of(ids(0, 7)).tolist() == [-1, -1]
    assert led.num_owned() == 0
    assert led.check_invariants() == []
    snap = led.snapshot()
    assert snap["generation"] == [0] * 8
    assert snap["writer_request"] == snap["previous_request"] == [-1] * 8
    assert snap["filled"] == [0] * 8
    assert snap["valid_for"] == [-1] * 8
    assert led.page_size == 16


def test_alloc_owns_and_bumps_generation() -> None:
    led = PageLedger(8)
    assert led.alloc(ids(1, 2), request=5, tenant=1) == ReuseStats(0, 0, 0)
    assert led.owner_of(ids(1, 2, 3)).tolist() == [5, 5, -1]
    assert led.owner_tenant_of([1, 2, 3]).tolist() == [1, 1, -1]
    assert led.tenant_of(5) == 1
    assert led.num_owned() == 2
    led.free(ids(1, 2))
    led.alloc(ids(2, 3), request=6, tenant=1)
    assert led.snapshot()["generation"][:4] == [0, 1, 2, 1]
    assert led.check_invariants() == []


def test_write_then_read_is_valid() -> None:
    led = PageLedger(8)
    led.alloc(ids(0, 1, 2), 1, 10)
    led.write(ids(0, 1, 2), 1)
    assert led.read(ids(0, 1, 2), 1) == []
    assert led.read(ids(0, 1, 2), ids(1, 1, 1)) == []
    assert not led.stale_mask(ids(0, 1, 2), 1).any()
    assert led.check_invariants() == []


def test_never_written() -> None:
    led = PageLedger(8, name="decode")
    led.alloc(ids(3, 4), 1, 10)
    led.write(ids(3), 1)
    assert led.read(ids(3, 4), 1) == [
        StaleRead(
            reader_request=1,
            reader_tenant=10,
            page_ids=[4],
            previous_request=None,
            previous_tenant=None,
            zeroized=False,
            read_kind="decode",
            pool="decode",
        )
    ]
    assert not led.read(ids(4), 1)[0].cross_tenant


def test_previous_owner_of_another_tenant() -> None:
    led = PageLedger(8)
    led.alloc(ids(0, 1), 1, 10)
    led.write(ids(0, 1), 1)
    led.free(ids(0, 1))
    assert led.alloc(ids(0, 1, 2), 2, 20) == ReuseStats(reused=2, cross_tenant=2, zeroized=0)
    led.write(ids(2), 2)
    (stale,) = led.read(ids(0, 1, 2), 2)
    assert (stale.reader_request, stale.reader_tenant) == (2, 20)
    assert (stale.previous_request, stale.previous_tenant) == (1, 10)
    assert stale.page_ids == [0, 1]
    assert stale.cross_tenant
    assert not stale.zeroized


def test_same_tenant_different_request() -> None:
    led = PageLedger(8)
    led.alloc(ids(0), 1, 10)
    led.write(ids(0), 1)
    led.free(ids(0))
    assert led.alloc(ids(0), 2, 10) == ReuseStats(reused=1, cross_tenant=0, zeroized=0)
    (stale,) = led.read(ids(0), 2)
    assert (stale.previous_request, stale.previous_tenant) == (1, 10)
    assert not stale.cross_tenant


def test_older_generation_same_request_handle_reused() -> None:
    led = PageLedger(8)
    led.alloc(ids(0), 1, 10)
    led.write(ids(0), 1)
    led.free(ids(0))
    led.alloc(ids(0), 1, 10)  # the handle is recycled and gets the same page back
    (stale,) = led.read(ids(0), 1)
    assert (stale.reader_request, stale.previous_request) == (1, 1)
    led.write(ids(0), 1)
    assert led.read(ids(0), 1) == []


def test_freed_then_read() -> None:
    led = PageLedger(8)
    led.alloc(ids(0, 1), 1, 10)
    led.write(ids(0, 1), 1)
    led.free(ids(1))  # early free: still in the block table
    (stale,) = led.read(ids(0, 1), 1)
    assert stale.page_ids == [1]
    assert stale.previous_request == 1
    # ... and then somebody else gets it and writes it: the reader sees that tenant's KV
    led.alloc(ids(1), 2, 20)
    led.write(ids(1), 2)
    (stale,) = led.read(ids(0, 1), 1)
    assert (stale.page_ids, stale.previous_request, stale.previous_tenant) == ([1], 2, 20)
    assert stale.cross_tenant


def test_zeroized() -> None:
    led = PageLedger(8)
    led.alloc(ids(0, 1), 1, 10)
    led.write(ids(0, 1), 1)
    led.free(ids(0, 1), zeroized=True)
    assert led.alloc(ids(0, 1), 2, 20) == ReuseStats(reused=0, cross_tenant=0, zeroized=2)
    (stale,) = led.read(ids(0, 1), 2)
    assert stale.zeroized
    assert (stale.previous_request, stale.previous_tenant) == (1, 10)
    assert not stale.cross_tenant  # zeros exposed, not tenant 10's KV
    led.write(ids(0), 2)
    (stale,) = led.read(ids(0, 1), 2)
    assert stale.page_ids == [1]
    assert led.snapshot()["zeroized"][:2] == [0, 1]


def test_reading_another_requests_pages() -> None:
    led = PageLedger(8)
    led.alloc(ids(0), 1, 10)
    led.write(ids(0), 1)
    led.alloc(ids(1), 2, 20)
    led.write(ids(1), 2)
    (stale,) = led.read(ids(0, 1), ids(1, 1))  # request 1 gathers request 2's page 1
    assert (stale.reader_request, stale.page_ids, stale.previous_tenant) == (1, [1], 20)
    assert stale.cross_tenant


def test_write_into_a_page_owned_by_another_request() -> None:
    led = PageLedger(8)
    led.alloc(ids(0), 1, 10)
    led.write(ids(0), 1)
    led.alloc(ids(1), 2, 20)
    led.write(ids(0), 2)  # engine bug: request 2 writes into request 1's page
    (stale,) = led.read(ids(0), 1)
    assert (stale.previous_request, stale.previous_tenant) == (2, 20)
    led.write(ids(0), 3, tenant=30)
    (stale,) = led.read(ids(0), 1)
    assert (stale.previous_request, stale.previous_tenant) == (3, 30)
    led.write(ids(0), 4)  # a request this ledger never saw allocate
    (stale,) = led.read(ids(0), 1)
    assert (stale.previous_request, stale.previous_tenant) == (4, -1)
    assert stale.cross_tenant


def test_hole_writes_validate_nothing() -> None:
    led = PageLedger(8)
    led.alloc(ids(0), 1, 10)
    led.write(ids(0), 1)
    led.free(ids(0))
    led.alloc(ids(0, 1), 2, 20)
    led.write(ids(0, 1), 2, start=1)  # appending a token to a stale page heals nothing
    stale = led.read(ids(0, 1), 2)
    assert [(s.page_ids, s.previous_request) for s in stale] == [([1], None), ([0], 1)]
    led.write(ids(1), 2)
    led.write(ids(1), 2, start=1)  # rewriting part of one's own valid page keeps it valid
    assert led.read(ids(1), 2) == []
    led.alloc(ids(2), 3, 30)
    led.write(ids(1), 3, start=1)  # another request writing into the prefix spoils it
    (stale,) = led.read(ids(1), 2)
    assert (stale.previous_request, stale.previous_tenant) == (3, 30)
    assert led.check_invariants() == []


def test_filled_grows_with_in_order_writes_only() -> None:
    led = PageLedger(4, page_size=8)
    led.alloc(ids(0), 1, 10)
    led.write(ids(0), 1, end=3)  # slots 0..2
    assert led.filled_of(ids(0)).tolist() == [3]
    assert led.read(ids(0), 1, upto=3) == [] and led.read(ids(0), 1, upto=0) == []
    assert [s.page_ids for s in led.read(ids(0), 1, upto=4)] == [[0]]
    led.write(ids(0), 1, start=3, end=4)  # an append at the end of the prefix extends it
    led.write(ids(0), 1, start=1, end=2)  # a rewrite inside it changes nothing
    assert led.filled_of(ids(0)).tolist() == [4]
    led.write(ids(0), 1, start=5, end=6)  # past the prefix: a hole (slot 4), nothing extends
    assert led.filled_of(ids(0)).tolist() == [4]
    led.write(ids(0), 1, start=4, end=5)  # slot 4 now; slot 5 is not remembered
    assert led.filled_of(ids(0)).tolist() == [5]
    assert led.read(ids(0), 1, upto=5) == []
    assert [s.page_ids for s in led.read(ids(0), 1, upto=6)] == [[0]]
    assert led.stale_mask(ids(0, 0, 0), 1, upto=ids(5, 6, 8)).tolist() == [False, True, True]
    assert led.stale_mask(ids(0), 1).tolist() == [True]  # no upto: the whole page is read
    led.write(ids(0), 1, start=5)  # to the end of the page
    assert led.read(ids(0), 1) == []
    assert led.check_invariants() == []


def test_any_stale_is_conservative_only_for_the_pages_of_unsettled_appends() -> None:
    """An append that is not all plain appends leaves its other writes to the next operation;
    until then any_stale answers True for a read of one of those pages, and exactly for
    every other page (the pages wait valid for nobody, not a ledger-wide flag)."""
    led = PageLedger(4, page_size=8)
    for page, req in ((0, 1), (1, 2), (2, 3)):
        led.alloc(ids(page), req, 10 * req)
        led.write(ids(page), req, end=2)

    def slots(n: int) -> torch.Tensor:  # a slot mask of slots 0..n-1 of one page
        return (torch.arange(8) < n)[None, :]

    # page 0: its owner's plain append at slot 2; page 1: request 3 writes into request 2's
    # prefix (spoils it); page 2 is not written
    led.append(ids(0, 1), ids(1, 3), ids(2, 1))
    assert bool(led.any_stale(ids(0), 1, slots(3))) is False  # exact: the append applied
    assert bool(led.any_stale(ids(2), 3, slots(2))) is False  # exact: not written
    assert bool(led.any_stale(ids(1), 2, slots(1))) is True  # waits: conservative
    (stale,) = led.read(ids(1), 2, slots(1))  # settles: exact
    assert (stale.previous_request, stale.page_ids) == (3, [1])
    assert bool(led.any_stale(ids(1), 2, slots(1))) is True
    assert bool(led.any_stale(ids(0), 1, slots(3))) is False
    assert bool(led.any_stale(ids(0), 1, slots(4))) is True  # slot 3 was never written
    assert led.check_invariants() == []


def test_placeholder_page_read_past_its_one_written_slot() -> None:
    """The incident's placeholder page: tenant 100's prompt fills a prefill page; it is freed;
    rejected request 2 (tenant 200) writes ONE token into slot 0 and the page is transferred;
    decode reads it as 16 positions. Slots 1..15 still hold tenant 100's KV: stale, naming
    request 1 and tenant 100 (cross-tenant), on the prefill side and after the transfer."""
    pre, dec = PageLedger(4, name="prefill"), PageLedger(4, name="decode")
    pre.alloc(ids(0), 1, 100)
    pre.write(ids(0), 1)
    pre.free(ids(0))
    pre.alloc(ids(0), 2, 200)
    pre.write(ids(0), 2, start=0, end=1)  # the one-token placeholder
    assert pre.read(ids(0), 2, upto=1) == []
    (stale,) = pre.read(ids(0), 2, upto=16)
    assert (stale.page_ids, stale.previous_request, stale.previous_tenant) == ([0], 1, 100)
    assert stale.cross_tenant and not stale.zeroized
    dec.alloc(ids(3), 2, 200)
    assert pre.transfer(ids(0), dec, ids(3), 2) == []  # the token it wrote is its own
    assert dec.filled_of(ids(3)).tolist() == [1]
    assert dec.read(ids(3), 2, upto=1) == []
    (stale,) = dec.read(ids(3).view(1, 1), ids(2).view(1, 1), upto=torch.tensor([[16]]))
    assert (stale.reader_request, stale.reader_tenant) == (2, 200)
    assert (stale.page_ids, stale.previous_request, stale.previous_tenant) == ([3], 1, 100)
    assert (stale.pool, stale.read_kind) == ("decode", "decode") and stale.cross_tenant
    # decode appends its tokens in order: the prefix grows, the hole does not go away
    dec.write(ids(3), 2, start=1, end=2)
    assert dec.read(ids(3), 2, upto=2) == []
    assert [s.previous_tenant for s in dec.read(ids(3), 2, upto=3)] == [100]
    assert pre.check_invariants() == [] and dec.check_invariants() == []


def test_hole_of_a_zeroized_page() -> None:
    led = PageLedger(4)
    led.alloc(ids(0), 1, 10)
    led.write(ids(0), 1)
    led.free(ids(0), zeroized=True)
    led.alloc(ids(0), 2, 20)
    led.write(ids(0), 2, end=1)
    (stale,) = led.read(ids(0), 2)
    assert (stale.previous_request, stale.previous_tenant, stale.zeroized) == (1, 10, True)
    assert not stale.cross_tenant  # zeros in the hole, not tenant 10's KV
    assert led.snapshot()["zeroized"][0] == 0  # the written prefix is not zeros
    assert led.check_invariants() == []


def test_another_writer_at_the_end_of_the_prefix_takes_over_the_hole() -> None:
    led = PageLedger(4)
    led.alloc(ids(0), 1, 10)
    led.write(ids(0), 1)
    led.free(ids(0))
    led.alloc(ids(0), 2, 20)
    led.write(ids(0), 2, end=4)
    led.write(ids(0), 3, start=5, tenant=30)  # past the prefix's end: changes nothing
    assert [s.previous_request for s in led.read(ids(0), 2, upto=16)] == [1]
    led.write(ids(0), 3, start=4, tenant=30)  # at the prefix's end: the hole is now 3's
    assert led.read(ids(0), 2, upto=4) == []
    (stale,) = led.read(ids(0), 2, upto=5)
    assert (stale.previous_request, stale.previous_tenant) == (3, 30)
    led.write(ids(0), 3, start=3, end=4, tenant=30)  # into the prefix: spoiled
    (stale,) = led.read(ids(0), 2, upto=1)
    assert (stale.previous_request, stale.previous_tenant) == (3, 30)
    assert led.filled_of(ids(0)).tolist() == [0]
    assert led.check_invariants() == []


def test_slot_arguments_are_checked() -> None:
    led = PageLedger(4, page_size=8)
    led.alloc(ids(0), 1, 10)
    for bad in ({"start": 8}, {"start": -1}, {"end": 0}, {"end": 9}, {"start": 3, "end": 3}):
        with pytest.raises(ValueError):
            led.write(ids(0), 1, **bad)
    with pytest.raises(ValueError):
        led.read(ids(0), 1, upto=9)
    with pytest.raises(TypeError):
        led.read(ids(0), 1, upto=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="broadcast"):
        led.read(ids(0, 1), 1, upto=ids(1, 2, 3))
    with pytest.raises(ValueError):
        PageLedger(4, page_size=0)


@pytest.mark.parametrize("page_size", [16, 8, 12, 1])
def test_slot_masks_read_up_to_their_last_slot(page_size: int) -> None:
    """A bool mask of the slots read (an engine's attention mask) reads up to its last set
    slot: the same verdict as that extent, holes below it or not, checked 8 slots per int64
    word where the page size allows, else through the extent (12, 1; or a strided mask)."""
    rng = random.Random(page_size)
    led = PageLedger(6, page_size=page_size)
    led.alloc(ids(0, 1, 2, 3, 4), 1, 10)
    led.alloc(ids(5), 2, 20)
    for page in range(6):
        led.write(ids(page), 1 if page < 5 else 2, end=rng.randint(1, page_size))
    led.write(ids(4), 3, start=0, end=1, tenant=30)  # spoiled: stale for 1 whatever is read
    pages = ids(0, 1, 2, 3, 4, 5, 0, 1)
    for _ in range(50):
        last = torch.tensor([rng.randint(0, page_size) for _ in range(8)])
        slots = torch.arange(page_size)[None, :]
        mask = (slots == last[:, None] - 1) | ((slots < last[:, None]) & (torch.rand(8, 1) < 0.5))
        expected = led.stale_mask(pages, 1, last)
        assert led.stale_mask(pages, 1, mask).tolist() == expected.tolist()
        assert bool(led.any_stale(pages, 1, mask)) == bool(expected.any())
        strided = mask.t().contiguous().t()  # same values, not contiguous: via the extent
        assert led.stale_mask(pages, 1, strided).tolist() == expected.tolist()
        table, table_mask = pages.view(2, 4), mask.view(2, 4, page_size)
        assert led.stale_mask(table, ids(1, 1).view(2, 1), table_mask).view(-1).tolist() == (
            expected.tolist()
        )
        assert [s.page_ids for s in led.read(pages, 1, mask)] == [
            s.page_ids for s in led.read(pages, 1, last)
        ]
    with pytest.raises(ValueError, match="slot mask"):
        led.stale_mask(pages, 1, torch.ones(8, page_size + 1, dtype=torch.bool))


def test_batched_write_one_writer_per_page() -> None:
    led = PageLedger(8)
    for r in range(3):
        led.alloc(ids(r), r, 10 + r)
    led.write(ids(0, 1), ids(0, 1))
    # a decode step: request 0 appends to page 0, 1 to page 1, 2 starts page 2
    led.write(ids(0, 1, 2), ids(0, 1, 2), start=torch.tensor([5, 16 - 1, 0]))
    assert led.read(ids(0, 1, 2), ids(0, 1, 2)) == []
    led.write(ids(2), ids(1), start=torch.tensor([1]))  # request 1 spoils request 2's page
    (stale,) = led.read(ids(0, 1, 2), ids(0, 1, 2))
    assert (stale.reader_request, stale.previous_request, stale.previous_tenant) == (2, 1, -1)
    led.write(ids(2), ids(1), tenant=ids(11))  # tenant given: named
    (stale,) = led.read(ids(2), 2)
    assert (stale.previous_request, stale.previous_tenant) == (1, 11)
    with pytest.raises(ValueError, match="broadcast"):
        led.write(ids(0, 1), ids(0, 1, 2))
    assert led.check_invariants() == []


def test_grants_make_a_prefix_hit_a_valid_read_until_the_page_changes() -> None:
    led = PageLedger(4, page_size=8)
    led.alloc([0, 1], request=1, tenant=10)
    led.write([0, 1], 1)
    led.alloc([2], request=2, tenant=20)
    led.write([2], 2)
    # Request 2 granted pages 0 and 1 (request 1's) ahead of its own page 2.
    assert led.read([0, 1, 2], 2) != []  # without the grant: another request's pages
    led.grant([0, 1], 2, 1)
    assert led.read([0, 1, 2], 2) == [] and led.granted(2) == 2
    assert led.read([0, 1], 3) != []  # nobody else was granted them
    # Page 1 handed out again and rewritten by request 3 of another tenant: stale for 2,
    # reported as request 2's read, naming request 3.
    led.alloc([1], request=3, tenant=30)
    led.write([1], 3)
    (stale,) = led.read([0, 1, 2], 2)
    assert (stale.reader_request, stale.reader_tenant, stale.page_ids) == (2, 20, [1])
    assert (stale.previous_request, stale.previous_tenant, stale.cross_tenant) == (3, 30, True)
    assert bool(led.any_stale(torch.tensor([0, 1]), torch.tensor([2, 2]))) is True
    led.revoke(2)
    assert led.granted(2) == 0 and led.read([0], 2) != []
    assert led.check_invariants() == []


def test_a_granted_read_past_the_granters_prefix_is_stale() -> None:
    led = PageLedger(2, page_size=8)
    led.alloc([0], request=1, tenant=1)
    led.write([0], 1, start=0, end=3)
    led.alloc([1], request=2, tenant=2)
    led.grant([0], 2, torch.tensor([1]), tenant=2)
    assert led.read([0], 2, 3) == []
    (stale,) = led.read([0], 2, 4)  # past what request 1 wrote: the hole's previous writer
    assert stale.reader_request == 2 and stale.previous_request is None


def test_a_transfer_of_granted_pages_names_their_writer() -> None:
    """A transfer consults no grant: a source page the request was only granted is a stale
    read naming the page's writer (the tenant exposed), not, as if it were checked as its
    granter's read past the prefix, who wrote before the granter (here nobody). The case
    hypothesis found: request 1 prefills pages, they are granted to request 0 (a prefix hit),
    and request 0 transfers them to decode."""
    pre, dec = PageLedger(6, name="prefill", page_size=8), PageLedger(8, name="decode", page_size=8)
    pre.alloc(ids(0, 2, 3), request=1, tenant=1)
    pre.write(ids(0, 2, 3), 1)
    pre.grant(ids(0, 2, 3), 0, 1, tenant=0)
    assert pre.read(ids(0, 2, 3), 0) == []  # the hit's decode reads are valid
    (stale,) = pre.transfer(ids(3, 0, 2), dec, ids(6, 0, 2), 0)
    assert (stale.read_kind, stale.pool, sorted(stale.page_ids)) == (
        "transfer",
        "prefill",
        [0, 2, 3],
    )
    assert (stale.reader_request, stale.reader_tenant) == (0, 0)
    assert (stale.previous_request, stale.previous_tenant, stale.zeroized) == (1, 1, False)
    assert stale.cross_tenant
    # the copies carry the writer in: decode's later reads of them name it too
    got = {(s.previous_request, s.previous_tenant) for s in dec.read(ids(6, 0, 2), 0)}
    assert got == {(1, 1)}
    assert pre.check_invariants() == [] and dec.check_invariants() == []


def test_transfer_of_valid_pages() -> None:
    pre, dec = PageLedger(4, name="prefill"), PageLedger(8, name="decode")
    pre.alloc(ids(0, 1), 1, 10)
    pre.write(ids(0, 1), 1)
    dec.alloc(ids(5, 6), 1, 10)
    assert pre.transfer(ids(0, 1), dec, ids(5, 6), 1) == []
    assert dec.read(ids(5, 6), 1) == []
    snap = dec.snapshot()
    assert snap["writer_request"][5:7] == [1, 1]
    assert snap["writer_tenant"][5:7] == [10, 10]
    assert dec.check_invariants() == []


def test_transfer_of_stale_source_pages() -> None:
    pre, dec = PageLedger(4, name="prefill"), PageLedger(8, name="decode")
    pre.alloc(ids(0), 1, 10)
    pre.write(ids(0), 1)
    pre.free(ids(0))
    pre.alloc(ids(0, 1), 2, 20)
    pre.write(ids(1), 2)  # page 0 still holds request 1's prompt (e.g. a rejected prefill)
    dec.alloc(ids(3, 4), 2, 20)
    (stale,) = pre.transfer(ids(0, 1), dec, ids(3, 4), 2)
    assert (stale.read_kind, stale.pool, stale.page_ids) == ("transfer", "prefill", [0])
    assert (stale.reader_request, stale.previous_request, stale.previous_tenant) == (2, 1, 10)
    # decode then reads the copy: flagged, naming the original writer
    (stale,) = dec.read(ids(3, 4), 2)
    assert (stale.read_kind, stale.pool, stale.page_ids) == ("decode", "decode", [3])
    assert (stale.previous_request, stale.previous_tenant) == (1, 10)
    assert stale.cross_tenant
    assert dec.check_invariants() == []


def test_transfer_carries_zeroized_and_never_written() -> None:
    pre, dec = PageLedger(4), PageLedger(4)
    pre.alloc(ids(0), 1, 10)
    pre.write(ids(0), 1)
    pre.free(ids(0), zeroized=True)
    pre.alloc(ids(0, 1), 2, 20)
    dec.alloc(ids(0, 1), 2, 20)
    got = {
        (s.page_ids[0], s.previous_request, s.zeroized)
        for s in pre.transfer([0, 1], dec, [0, 1], 2)
    }
    assert got == {(0, 1, True), (1, None, False)}
    got = {(s.page_ids[0], s.previous_request, s.zeroized) for s in dec.read([0, 1], 2)}
    assert got == {(0, 1, True), (1, None, False)}


def test_dropped_transfer() -> None:
    """Decode allocated the pages, the transfer never came: decode reads the old occupant."""
    dec = PageLedger(8, name="decode")
    dec.alloc(ids(2), 7, 70)
    dec.write(ids(2), 7)
    dec.free(ids(2))
    dec.alloc(ids(1, 2), 8, 80)
    stale = dec.read(ids(1, 2), 8)
    assert {(s.page_ids[0], s.previous_request, s.previous_tenant) for s in stale} == {
        (1, None, None),
        (2, 7, 70),
    }
    assert [s.cross_tenant for s in stale if s.previous_request == 7] == [True]


def test_transfer_within_one_ledger_and_length_mismatch() -> None:
    led = PageLedger(8)
    led.alloc(ids(0, 1, 2, 3), 1, 10)
    led.write(ids(0, 1), 1)
    assert led.transfer(ids(0, 1), led, ids(1, 2), 1) == []  # overlapping copy
    assert led.read(ids(0, 1, 2), 1) == []
    with pytest.raises(ValueError, match="as many"):
        led.transfer(ids(0, 1), led, ids(3), 1)


def test_block_table_shapes_and_grouping() -> None:
    led = PageLedger(16)
    for r in range(3):
        led.alloc(ids(*range(4 * r, 4 * r + 4)), r, r % 2)
        led.write(ids(*range(4 * r, 4 * r + 3)), r)  # the last page of each is never written
    table = torch.arange(12).view(3, 4)
    stale = led.read(table, torch.arange(3).view(3, 1))
    assert [(s.reader_request, s.page_ids) for s in stale] == [(0, [3]), (1, [7]), (2, [11])]
    assert led.stale_mask(table, torch.arange(3).view(3, 1)).sum().item() == 3
    # one reader reading everybody's pages: grouped per previous writer, in read order
    stale = led.read(table.flip(0), 0)
    assert [(s.previous_request, s.page_ids) for s in stale] == [
        (None, [11, 7, 3]),
        (1, [4, 5, 6]),
        (2, [8, 9, 10]),
    ]
    with pytest.raises(ValueError, match="broadcast"):
        led.read(table, torch.arange(3))
    assert led.read(torch.empty(0, dtype=torch.long), 0) == []


def test_negative_or_bad_handles_are_rejected_or_flagged() -> None:
    led = PageLedger(4)
    with pytest.raises(ValueError):
        led.alloc(ids(0), -1, 0)
    with pytest.raises(ValueError):
        led.alloc(ids(0), 1, -3)
    with pytest.raises(ValueError):
        led.read(ids(0), -1)
    with pytest.raises(TypeError):
        led.read(torch.tensor([0.0]), 1)
    with pytest.raises(ValueError):
        PageLedger(-1)
    # a free, never-written page has valid_for == -1: a reader handle of -1 must not match
    assert [s.page_ids for s in led.read(ids(0, 1), ids(-1, -1))] == [[0, 1]]


def test_alloc_counts_is_sync_free_variant() -> None:
    led = PageLedger(8)
    led.alloc(ids(0, 1), 1, 10)
    led.write(ids(0, 1), 1)
    led.free(ids(0))
    led.free(ids(1), zeroized=True)
    counts = led.alloc_counts(ids(0, 1, 2), 2, 20)
    assert isinstance(counts, torch.Tensor)
    assert counts.tolist() == [1, 1, 1]


def test_alloc_counts_with_one_owner_per_page_equals_one_call_per_owner() -> None:
    """A batch of several requests' allocations in one call (a host-side engine's
    deferred operations) leaves the ledger as the calls one by one would."""

    def history(led: PageLedger) -> None:
        led.alloc(ids(0, 1, 2), 1, 10)
        led.write(ids(0, 1), 1)
        led.free(ids(0, 1, 2))
        led.free(ids(2), zeroized=True)

    one_by_one, batched = PageLedger(8), PageLedger(8)
    history(one_by_one)
    history(batched)
    a = one_by_one.alloc_counts(ids(0, 3), 2, 20) + one_by_one.alloc_counts(ids(1, 2), 3, 10)
    b = batched.alloc_counts(ids(0, 3, 1, 2), ids(2, 2, 3, 3), ids(20, 20, 10, 10))
    assert b.tolist() == a.tolist() == [2, 1, 1]
    assert batched.snapshot() == one_by_one.snapshot()
    assert [batched.tenant_of(r) for r in (2, 3)] == [20, 10]
    assert not batched.check_invariants()
    with pytest.raises(ValueError, match="non-negative"):
        batched.alloc_counts(ids(4), ids(-1), 1)


def test_tenant_memory_is_bounded() -> None:
    led = PageLedger(4, tenant_capacity=2)
    for r in range(3):
        led.alloc(ids(r), r, 10 + r)
    assert [led.tenant_of(r) for r in range(3)] == [-1, 11, 12]


def test_stale_read_cross_tenant_property() -> None:
    base = dict(reader_request=1, page_ids=[0], previous_request=2, read_kind="decode")
    assert StaleRead(reader_tenant=1, previous_tenant=2, zeroized=False, **base).cross_tenant
    assert not StaleRead(reader_tenant=1, previous_tenant=1, zeroized=False, **base).cross_tenant
    assert not StaleRead(reader_tenant=1, previous_tenant=2, zeroized=True, **base).cross_tenant
    assert not StaleRead(reader_tenant=1, previous_tenant=None, zeroized=False, **base).cross_tenant
    assert StaleRead(reader_tenant=-1, previous_tenant=-1, zeroized=False, **base).cross_tenant


@pytest.mark.parametrize("device", DEVICES)
def test_incident_scenario_on_device(device: str) -> None:
    """Tenant A's prompt sits in decode pages; B's over-length prompt is rejected, its partial
    KV transferred, decode reads pages nobody overwrote."""
    pre = PageLedger(8, device=device, name="prefill")
    dec = PageLedger(16, device=device, name="decode")
    assert pre.device.type == device and dec.device.type == device
    a, b = 1, 2
    pre.alloc(ids(0, 1, 2, device=device), a, 100)
    pre.write(ids(0, 1, 2, device=device), a)
    dec.alloc(ids(4, 5, 6, device=device), a, 100)
    assert pre.transfer(ids(0, 1, 2, device=device), dec, ids(4, 5, 6, device=device), a) == []
    pre.free(ids(0, 1, 2, device=device))
    assert dec.read(ids(4, 5, 6, device=device), a) == []
    dec.free(ids(4, 5, 6, device=device))
    # B: rejected, one-token placeholder written to one prefill page, the rest carried over
    pre.alloc(ids(0, 1, device=device), b, 200)
    pre.write(ids(0, device=device), b, end=1)
    dec.alloc(ids(4, 5, 6, device=device), b, 200)
    (t_stale,) = pre.transfer(ids(0, 1, device=device), dec, ids(4, 5, device=device), b)
    assert (t_stale.read_kind, t_stale.page_ids, t_stale.previous_tenant) == ("transfer", [1], 100)
    table, reader = ids(4, 5, 6, device=device).view(1, 3), ids(b, device=device).view(1, 1)
    # page 4 holds one token of B's and 15 of A's: valid read as 1 position, stale as 16
    reads = dec.read(table, reader, upto=ids(1, 16, 9, device=device).view(1, 3))
    got = {
        (tuple(s.page_ids), s.previous_request, s.previous_tenant, s.cross_tenant) for s in reads
    }
    assert got == {((5, 6), a, 100, True)}
    reads = dec.read(table, reader)
    got = {
        (tuple(s.page_ids), s.previous_request, s.previous_tenant, s.cross_tenant) for s in reads
    }
    assert got == {((4, 5, 6), a, 100, True)}
    assert pre.check_invariants() == [] and dec.check_invariants() == []


@needs_cuda
def test_transfer_across_devices() -> None:
    pre, dec = PageLedger(4, device="cpu"), PageLedger(4, device="cuda")
    pre.alloc([0, 1], 1, 10)
    pre.write([0], 1)
    dec.alloc([2, 3], 1, 10)
    assert [s.page_ids for s in pre.transfer([0, 1], dec, [2, 3], 1)] == [[1]]
    assert [s.page_ids for s in dec.read([2, 3], 1)] == [[3]]
    pre.free([0, 1])
    pre.alloc([0], 2, 20)
    pre.write([0], 2, end=1)
    dec.alloc([1], 2, 20)
    assert pre.transfer([0], dec, [1], 2) == []
    ((page, prev),) = [(s.page_ids, s.previous_tenant) for s in dec.read([1, 1], 2, ids(1, 2))]
    assert (page, prev) == ([1], 10)
    assert dec.check_invariants() == []


# --------------------------------------------------------------------------- reference model

Report = tuple[int, int, int, int | None, int | None, bool, str, str]
SLOTS = 8  # slots per page in the property tests: few, so that slot ranges meet often
Truth = tuple[int, int] | None


@dataclass
class RefPage:
    owner: int = -1
    owner_tenant: int = -1
    gen: int = 0
    writer: int | None = None  # None: never written since the pool was created
    writer_tenant: int = -1
    written_gen: int | None = None  # None: never written, or carried in by a stale transfer
    zeroized: bool = False
    filled: int = 0  # leading slots the owner wrote in this generation
    prev: int | None = None  # who the slots past ``filled`` are attributed to
    prev_tenant: int = -1
    prev_zeroized: bool = False
    # The truth, slot by slot, kept apart from the ledger's rules: the (request, generation)
    # that wrote each slot while owning the page; None: anybody else, or nobody.
    slots: list[Truth] = field(default_factory=lambda: [None] * SLOTS)

    def attribute_whole_page_to_writer(self) -> None:
        self.prev, self.prev_tenant, self.prev_zeroized = (
            self.writer,
            self.writer_tenant,
            self.zeroized,
        )


@dataclass
class RefPool:
    """The ledger's contract, written as plainly as possible, one page and one slot at a time.

    Besides the contract's state, each page keeps the truth per slot (who wrote it while
    owning the page, in which generation), which the ledger does not have: a read the
    contract passes must be truly valid (no false negative, whatever the interleaving), and
    for an engine that writes each page's slots in order the two must agree exactly."""

    n: int
    name: str
    pages: list[RefPage] = field(init=False)
    tenants: dict[int, int] = field(default_factory=dict)
    #: (reader, page) -> the granter its reads of that page are checked as (prefix caching)
    grants: dict[tuple[int, int], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pages = [RefPage() for _ in range(self.n)]

    def tenant_of(self, r: int) -> int:
        return self.tenants.get(r, -1)

    def owned_by(self, r: int) -> list[int]:
        return [i for i, pg in enumerate(self.pages) if pg.owner == r]

    def free_pages(self) -> list[int]:
        return [i for i, pg in enumerate(self.pages) if pg.owner == -1]

    def valid(self, p: int, r: int) -> bool:
        """Page level: ``r`` owns the page and wrote it in its current generation."""
        pg = self.pages[p]
        return pg.owner == r and pg.writer == r and pg.written_gen == pg.gen and not pg.zeroized

    def checked_as(self, p: int, r: int) -> int:
        return self.grants.get((r, p), r)

    def reads_valid(self, p: int, r: int, upto: int) -> bool:
        a = self.checked_as(p, r)
        return self.valid(p, a) and upto <= self.pages[p].filled

    def truly_valid(self, p: int, r: int, upto: int) -> bool:
        """The truth: the slots read hold the write of the reader (or of whoever granted it
        the page), in the page's current generation, which that request still owns."""
        a = self.checked_as(p, r)
        pg = self.pages[p]
        return pg.owner == a and all(t == (a, pg.gen) for t in pg.slots[:upto])

    def grant(self, pages: list[int], r: int, granters: list[int], tenant: int | None) -> None:
        for p, g in zip(pages, granters, strict=True):
            self.grants[(r, p)] = g
        if tenant is not None:
            self.tenants[r] = tenant

    def revoke(self, r: int) -> None:
        self.grants = {k: g for k, g in self.grants.items() if k[0] != r}

    def alloc(self, pages: list[int], r: int, t: int) -> ReuseStats:
        reused = cross = zeroized = 0
        for p in pages:
            pg = self.pages[p]
            holds = pg.writer is not None and not pg.zeroized
            reused += holds
            cross += holds and pg.writer_tenant != t
            zeroized += pg.zeroized
            pg.owner, pg.owner_tenant, pg.gen, pg.filled = r, t, pg.gen + 1, 0
            pg.attribute_whole_page_to_writer()
        self.tenants[r] = t
        return ReuseStats(reused, cross, zeroized)

    def write(
        self,
        pages: list[int],
        writers: list[int],
        starts: list[int],
        ends: list[int],
        known_tenant: bool,
    ) -> None:
        """``known_tenant``: a single-handle write, where the ledger looks the tenant up."""
        for p, r, s, e in zip(pages, writers, starts, ends, strict=True):
            pg = self.pages[p]
            mine = pg.owner == r
            tenant = pg.owner_tenant if mine else (self.tenant_of(r) if known_tenant else -1)
            for j in range(s, e):
                pg.slots[j] = (r, pg.gen) if mine else None
            f = pg.filled
            if mine and s <= f:  # the owner starts its prefix, or extends it
                pg.filled = max(f, e)
                pg.writer, pg.writer_tenant, pg.written_gen, pg.zeroized = r, tenant, pg.gen, False
            elif not mine and (s < f or s == f == 0):  # into the prefix, or slot 0 of a stale page
                pg.filled = 0
                pg.writer, pg.writer_tenant, pg.written_gen, pg.zeroized = r, tenant, pg.gen, False
                pg.attribute_whole_page_to_writer()
            elif not mine and s == f:  # at the prefix's end: what lies past it is r's now
                pg.prev, pg.prev_tenant, pg.prev_zeroized = r, tenant, False
            # else: the write starts past the prefix (a hole), and changes nothing

    def free(self, pages: list[int], zeroized: bool) -> None:
        for p in pages:
            pg = self.pages[p]
            pg.owner = pg.owner_tenant = -1
            pg.filled = 0
            pg.zeroized = pg.zeroized or zeroized
            pg.attribute_whole_page_to_writer()

    def stale(self, p: int, r: int, kind: str) -> Report:
        """The report of a stale read of ``p`` by ``r``: past the reader's own prefix (or
        its granter's, for a decode read of a granted page), it names who the rest is
        attributed to; otherwise the page's last writer. Transfers consult no grant."""
        pg = self.pages[p]
        if self.valid(p, self.checked_as(p, r) if kind == "decode" else r):
            w, wt, z = pg.prev, pg.prev_tenant, pg.prev_zeroized
        else:
            w, wt, z = pg.writer, pg.writer_tenant, pg.zeroized
        return (r, self.tenant_of(r), p, w, None if w is None else wt, z, kind, self.name)

    def read(self, pages: list[int], readers: list[int], uptos: list[int]) -> Counter[Report]:
        return Counter(
            self.stale(p, r, "decode")
            for p, r, u in zip(pages, readers, uptos, strict=True)
            if not self.reads_valid(p, r, u)
        )

    def transfer(
        self, src: list[int], dst: RefPool, dst_pages: list[int], r: int
    ) -> Counter[Report]:
        out: Counter[Report] = Counter()
        carried = []
        for s in src:
            pg = self.pages[s]
            ours = [pg.owner == r and t == (r, pg.gen) for t in pg.slots]
            if self.valid(s, r):
                rest = (pg.prev, pg.prev_tenant, pg.prev_zeroized)
                carried.append((True, r, pg.owner_tenant, False, pg.filled, rest, ours))
            else:
                out[self.stale(s, r, "transfer")] += 1
                carried.append((False, pg.writer, pg.writer_tenant, pg.zeroized, 0, None, ours))
        for d, (ok, w, wt, z, filled, rest, ours) in zip(dst_pages, carried, strict=True):
            dp = dst.pages[d]
            dp.writer, dp.writer_tenant, dp.zeroized = w, wt, z
            dp.written_gen = dp.gen if ok else None
            valid_here = ok and dp.owner == r
            dp.filled = filled if valid_here else 0
            if valid_here:
                assert rest is not None
                dp.prev, dp.prev_tenant, dp.prev_zeroized = rest
            else:
                dp.attribute_whole_page_to_writer()
            dp.slots = [(r, dp.gen) if o and dp.owner == r else None for o in ours]
        return out

    def snapshot(self) -> dict[str, list[int]]:
        return {
            "owner_request": [pg.owner for pg in self.pages],
            "owner_tenant": [pg.owner_tenant for pg in self.pages],
            "generation": [pg.gen for pg in self.pages],
            "writer_request": [-1 if pg.writer is None else pg.writer for pg in self.pages],
            "writer_tenant": [pg.writer_tenant for pg in self.pages],
            "writer_generation": [
                -1 if pg.written_gen is None else pg.written_gen for pg in self.pages
            ],
            "zeroized": [int(pg.zeroized) for pg in self.pages],
            "filled": [pg.filled for pg in self.pages],
            "previous_request": [-1 if pg.prev is None else pg.prev for pg in self.pages],
            "previous_tenant": [pg.prev_tenant for pg in self.pages],
            "previous_zeroized": [int(pg.prev_zeroized) for pg in self.pages],
        }


def flatten(reports: list[StaleRead]) -> Counter[Report]:
    """One entry per stale page read; also checks the grouping (one group per key)."""
    out: Counter[Report] = Counter()
    keys = set()
    for s in reports:
        key = (s.reader_request, s.previous_request, s.previous_tenant, s.zeroized)
        assert key not in keys, f"group {key} reported twice"
        keys.add(key)
        assert s.page_ids
        for p in s.page_ids:
            out[
                (
                    s.reader_request,
                    s.reader_tenant,
                    p,
                    s.previous_request,
                    s.previous_tenant,
                    s.zeroized,
                    s.read_kind,
                    s.pool,
                )
            ] += 1
    return out


Table = tuple[int, list[int], list[int]]  # reader, pages, slots read of each page


class Pair:
    """A ledger and its reference model, driven together; every outcome is compared."""

    def __init__(self, n: int, name: str, device: str) -> None:
        self.ledger = PageLedger(n, device=device, name=name, page_size=SLOTS)
        self.model = RefPool(n, name)
        self.device = device

    def t(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def alloc(self, pages: list[int], r: int, tenant: int) -> None:
        assert self.ledger.alloc(self.t(pages), r, tenant) == self.model.alloc(pages, r, tenant)

    def write(
        self,
        pages: list[int],
        r: int | list[int],
        start: int | list[int] = 0,
        end: int | list[int] | None = None,
    ) -> None:
        """One writer handle or one per page; one slot range or one per page (``end=None``:
        to the end of the page)."""
        n = len(pages)
        writers = r if isinstance(r, list) else [r] * n
        starts = start if isinstance(start, list) else [start] * n
        ends = end if isinstance(end, list) else [SLOTS if end is None else end] * n
        self.ledger.write(
            self.t(pages),
            self.t(r) if isinstance(r, list) else r,
            start=self.t(start) if isinstance(start, list) else start,
            end=self.t(end) if isinstance(end, list) else end,
        )
        self.model.write(pages, writers, starts, ends, known_tenant=not isinstance(r, list))

    def append(self, pages: list[int], r: int | list[int], slot: int | list[int]) -> None:
        """``PageLedger.append``: must leave exactly what the one-slot write leaves."""
        n = len(pages)
        writers = r if isinstance(r, list) else [r] * n
        slots = slot if isinstance(slot, list) else [slot] * n
        self.ledger.append(
            self.t(pages),
            self.t(r) if isinstance(r, list) else r,
            self.t(slot) if isinstance(slot, list) else slot,
        )
        ends = [s + 1 for s in slots]
        self.model.write(pages, writers, slots, ends, known_tenant=not isinstance(r, list))

    def free(self, pages: list[int], zeroized: bool) -> None:
        self.ledger.free(self.t(pages), zeroized=zeroized)
        self.model.free(pages, zeroized)

    def grant(self, pages: list[int], r: int, granters: list[int], tenant: int | None) -> None:
        one = len(set(granters)) == 1 and len(pages) % 2 == 1
        self.ledger.grant(self.t(pages), r, granters[0] if one else self.t(granters), tenant)
        self.model.grant(pages, r, granters, tenant)

    def revoke(self, r: int) -> None:
        self.ledger.revoke(r)
        self.model.revoke(r)

    def read(
        self,
        tables: list[Table],
        as_2d: bool = False,
        exact: bool = False,
        rng: random.Random | None = None,
    ) -> Counter[Report]:
        """Read each table's pages (slots ``[0, upto)`` of each) for its reader. ``as_2d``:
        one ``[readers, pages]`` block table (tables of one length). ``exact``: the contract
        must agree with the truth both ways (an engine writing slots in order); otherwise only
        its valid reads must be truly valid. ``rng``: sometimes pass the extents as a slot
        mask (as an engine's attention mask), with holes below the last slot read."""
        pages = [p for _, table, _ in tables for p in table]
        readers = [r for r, table, _ in tables for _ in table]
        uptos = [u for _, _, us in tables for u in us]
        model = self.model
        for p, r, u in zip(pages, readers, uptos, strict=True):
            claimed, truly = model.reads_valid(p, r, u), model.truly_valid(p, r, u)
            assert truly or not claimed, f"false negative: page {p} slots [0, {u}) for {r}"
            assert truly == claimed or not exact, f"page {p} slots [0, {u}) for {r}: {truly}"
        expected = model.read(pages, readers, uptos)
        upto: torch.Tensor | int | None
        if rng is not None and rng.random() < 0.4:
            rows = [slot_mask(rng, u) for u in uptos]
            mask = torch.tensor(rows, dtype=torch.bool, device=self.device).view(-1, SLOTS)
            upto = mask.view(len(tables), len(tables[0][1]), SLOTS) if as_2d else mask
        elif all(u == SLOTS for u in uptos) and len(uptos) % 2:  # the default: whole pages
            upto = None
        elif len(set(uptos)) == 1 and len(uptos) % 3:
            upto = uptos[0]
        elif as_2d:
            upto = self.t([us for _, _, us in tables])
        else:
            upto = self.t(uptos)
        args: tuple[torch.Tensor, torch.Tensor | int]
        if as_2d:
            args = (
                self.t([table for _, table, _ in tables]),
                self.t([r for r, _, _ in tables]).view(-1, 1),
            )
        elif len(tables) == 1:
            args = (self.t(pages), tables[0][0])
        else:
            args = (self.t(pages), self.t(readers))
        maybe = bool(self.ledger.any_stale(*args, upto))  # conservative before a settle
        assert maybe or not expected
        got = self.ledger.read(*args, upto)
        assert flatten(got) == expected
        assert bool(self.ledger.any_stale(*args, upto)) == bool(expected)
        return expected

    def transfer(self, src: list[int], dst: Pair, dst_pages: list[int], r: int) -> None:
        expected = self.model.transfer(src, dst.model, dst_pages, r)
        got = self.ledger.transfer(self.t(src), dst.ledger, dst.t(dst_pages), r)
        assert flatten(got) == expected

    def check(self) -> None:
        model = self.model
        for i, pg in enumerate(model.pages):  # the page-level and the slot rules agree
            assert (pg.filled > 0) == model.valid(i, pg.owner), f"page {i}: {pg}"
        snap = self.ledger.snapshot()
        assert snap.pop("valid_for") == [
            pg.owner if model.valid(i, pg.owner) else -1 for i, pg in enumerate(model.pages)
        ]
        assert snap == model.snapshot()
        assert self.ledger.check_invariants() == []


REQUESTS = st.integers(0, 5)


def tenant_of(r: int) -> int:
    return r % 3  # requests 0 and 3 share a tenant: same tenant, different request


SEEDS = st.integers(0, 2**32 - 1)


def some(data: st.DataObject, pool: list[int], max_size: int = 4) -> list[int]:
    """A random subset of ``pool`` (up to ``max_size``) in random order. Drawn from a seed:
    building a fresh strategy per draw made the state machines several times slower."""
    if not pool:
        return []
    rng = random.Random(data.draw(SEEDS))
    return rng.sample(pool, rng.randint(0, min(max_size, len(pool))))


def slot_range(rng: random.Random, filled: int) -> tuple[int, int]:
    """A write's slot range: from the page's first slot, from the end of its prefix (an
    append), or anywhere (a hole when past the prefix)."""
    kind = rng.random()
    if kind < 0.3:
        start = 0
    elif kind < 0.7:
        start = min(filled, SLOTS - 1)
    else:
        start = rng.randrange(SLOTS)
    end = start + 1 if rng.random() < 0.5 else rng.randint(start + 1, SLOTS)
    return start, end


def slot_mask(rng: random.Random, upto: int) -> list[bool]:
    """Slots ``[0, upto)`` read as a mask: all of them, or some, with the last one set."""
    if rng.random() < 0.5:
        return [j < upto for j in range(SLOTS)]
    return [j == upto - 1 or (j < upto and rng.random() < 0.5) for j in range(SLOTS)]


def read_extent(rng: random.Random, filled: int) -> int:
    """How many slots of a page a read covers: all, just the prefix, one past it, any."""
    return rng.choice([SLOTS, filled, min(filled + 1, SLOTS), rng.randint(0, SLOTS)])


class LedgerMachine(RuleBasedStateMachine):
    """Arbitrary interleavings of the raw operations on two pools, protocol-abiding or not."""

    DEVICE = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self.pools = {
            "prefill": Pair(6, "prefill", self.DEVICE),
            "decode": Pair(8, "decode", self.DEVICE),
        }

    @rule(pool=st.sampled_from(["prefill", "decode"]), r=REQUESTS, data=st.data())
    def alloc_free_pages(self, pool: str, r: int, data: st.DataObject) -> None:
        pair = self.pools[pool]
        pair.alloc(some(data, pair.model.free_pages()), r, tenant_of(r))

    @rule(pool=st.sampled_from(["prefill", "decode"]), r=REQUESTS, data=st.data())
    def alloc_any_pages(self, pool: str, r: int, data: st.DataObject) -> None:
        pair = self.pools[pool]  # double allocation: an engine bug the ledger must survive
        pair.alloc(some(data, list(range(pair.model.n))), r, tenant_of(r))

    @rule(
        pool=st.sampled_from(["prefill", "decode"]),
        r=REQUESTS,
        own=st.booleans(),
        whole=st.booleans(),
        data=st.data(),
    )
    def write(self, pool: str, r: int, own: bool, whole: bool, data: st.DataObject) -> None:
        """One writer, one slot range for every page (whole pages: the default range)."""
        pair = self.pools[pool]
        candidates = pair.model.owned_by(r) if own else list(range(pair.model.n))
        pages = some(data, candidates)
        if whole:
            pair.write(pages, r)
            return
        rng = random.Random(data.draw(SEEDS))
        start, end = slot_range(rng, pair.model.pages[pages[0]].filled if pages else 0)
        pair.write(pages, r, start, end)

    @rule(pool=st.sampled_from(["prefill", "decode"]), r=REQUESTS, data=st.data())
    def prefill(self, pool: str, r: int, data: st.DataObject) -> None:
        """Free pages allocated and written in order, the last one partly: a prompt."""
        pair = self.pools[pool]
        pages = some(data, pair.model.free_pages())
        pair.alloc(pages, r, tenant_of(r))
        if pages:
            last = random.Random(data.draw(SEEDS)).randint(1, SLOTS)
            pair.write(pages, r, 0, [SLOTS] * (len(pages) - 1) + [last])

    @rule(pool=st.sampled_from(["prefill", "decode"]), r=REQUESTS, data=st.data())
    def append(self, pool: str, r: int, data: st.DataObject) -> None:
        """The common case: an owner appends to its pages' prefixes (from slot 0 on a page
        not written yet), so that valid pages, partly filled ones and their holes abound."""
        pair = self.pools[pool]
        rng = random.Random(data.draw(SEEDS))
        pages = [
            p for p in some(data, pair.model.owned_by(r)) if pair.model.pages[p].filled < SLOTS
        ]
        starts = [pair.model.pages[p].filled for p in pages]
        ends = [rng.randint(s + 1, SLOTS) for s in starts]
        pair.write(pages, r, starts, ends)

    @rule(pool=st.sampled_from(["prefill", "decode"]), data=st.data())
    def append_batch(self, pool: str, data: st.DataObject) -> None:
        """``PageLedger.append``, a decode step's writes: one slot per page, mostly each
        page's owner at the end of its prefix, sometimes anyone anywhere (an engine bug)."""
        pair = self.pools[pool]
        rng = random.Random(data.draw(SEEDS))
        pages = some(data, list(range(pair.model.n)))
        model = pair.model.pages
        writers = [
            model[p].owner if model[p].owner >= 0 and rng.random() < 0.8 else rng.randrange(6)
            for p in pages
        ]
        slots = [
            min(model[p].filled, SLOTS - 1) if rng.random() < 0.8 else rng.randrange(SLOTS)
            for p in pages
        ]
        one_writer = len(set(writers)) == 1 and rng.random() < 0.5
        one_slot = len(set(slots)) == 1 and rng.random() < 0.5
        pair.append(pages, writers[0] if one_writer else writers, slots[0] if one_slot else slots)

    @rule(pool=st.sampled_from(["prefill", "decode"]), data=st.data())
    def write_batch(self, pool: str, data: st.DataObject) -> None:
        """One call, a writer and a slot range per page (a decode step's writes); pages
        mostly their writer's own."""
        pair = self.pools[pool]
        rng = random.Random(data.draw(SEEDS))
        pages = some(data, list(range(pair.model.n)))
        writers = [
            pair.model.pages[p].owner
            if pair.model.pages[p].owner >= 0 and rng.random() < 0.7
            else rng.randrange(6)
            for p in pages
        ]
        ranges = [slot_range(rng, pair.model.pages[p].filled) for p in pages]
        starts, ends = [s for s, _ in ranges], [e for _, e in ranges]
        if rng.random() < 0.3 and pages:  # one start for all: a tensor of ends, or ints
            starts = [starts[0]] * len(pages)
            ends = [max(e, starts[0] + 1) for e in ends]
            pair.write(pages, writers, starts[0], ends if rng.random() < 0.5 else max(ends))
        else:
            pair.write(pages, writers, starts, ends)

    @rule(
        pool=st.sampled_from(["prefill", "decode"]),
        r=REQUESTS,
        own=st.booleans(),
        zeroized=st.booleans(),
        data=st.data(),
    )
    def free(self, pool: str, r: int, own: bool, zeroized: bool, data: st.DataObject) -> None:
        pair = self.pools[pool]
        candidates = pair.model.owned_by(r) if own else list(range(pair.model.n))
        pair.free(some(data, candidates), zeroized)

    @rule(pool=st.sampled_from(["prefill", "decode"]), data=st.data())
    def read(self, pool: str, data: st.DataObject) -> None:
        pair = self.pools[pool]
        rng = random.Random(data.draw(SEEDS))
        readers = data.draw(st.lists(REQUESTS, unique=True, min_size=1, max_size=3))
        same_upto = rng.random() < 0.3
        tables: list[Table] = []
        for r in readers:
            table = pair.model.owned_by(r)
            if data.draw(st.booleans()):  # plus pages it does not own
                table += some(data, list(range(pair.model.n)), 2)
            uptos = [read_extent(rng, pair.model.pages[p].filled) for p in table]
            tables.append((r, table, [SLOTS] * len(table) if same_upto else uptos))
        same_len = len({len(t) for _, t, _ in tables}) == 1
        pair.read(tables, as_2d=same_len and data.draw(st.booleans()), rng=rng)

    @rule(pool=st.sampled_from(["prefill", "decode"]), data=st.data())
    def read_at_the_prefix(self, pool: str, data: st.DataObject) -> None:
        """Pages valid for their owners, read by them up to the end of their prefix or one
        slot past it: the boundary the check draws."""
        pair = self.pools[pool]
        rng = random.Random(data.draw(SEEDS))
        model = pair.model
        valid = [
            i for i, pg in enumerate(model.pages) if pg.owner >= 0 and model.valid(i, pg.owner)
        ]
        tables: dict[int, tuple[list[int], list[int]]] = {}
        for p in rng.sample(valid, min(len(valid), rng.randint(1, 4))):
            pages, uptos = tables.setdefault(model.pages[p].owner, ([], []))
            pages.append(p)
            uptos.append(min(SLOTS, model.pages[p].filled + rng.randint(0, 1)))
        if tables:
            pair.read([(r, pages, uptos) for r, (pages, uptos) in tables.items()], rng=rng)

    @rule(pool=st.sampled_from(["prefill", "decode"]), r=REQUESTS, data=st.data())
    def grant_hit(self, pool: str, r: int, data: st.DataObject) -> None:
        """A prefix-cache hit: pages another request owns (and wrote, mostly) granted to
        ``r`` as that request's; sometimes naming a granter that is not the owner (an
        engine bug the ledger must catch on the next read)."""
        pair = self.pools[pool]
        rng = random.Random(data.draw(SEEDS))
        model = pair.model
        pages = some(data, [i for i, pg in enumerate(model.pages) if pg.owner not in (-1, r)])
        granters = [
            model.pages[p].owner if rng.random() < 0.85 else rng.randrange(6) for p in pages
        ]
        if pages:
            pair.grant(pages, r, granters, tenant_of(r) if rng.random() < 0.5 else None)

    @rule(pool=st.sampled_from(["prefill", "decode"]), g=REQUESTS, r=REQUESTS, data=st.data())
    def cache_hit(self, pool: str, g: int, r: int, data: st.DataObject) -> None:
        """The whole life of a hit: ``g`` prefills free pages (whole), they are granted to
        ``r`` as ``g``'s, and ``r`` reads them (later operations may spoil them)."""
        pair = self.pools[pool]
        pages = some(data, pair.model.free_pages())
        if not pages or g == r:
            return
        pair.alloc(pages, g, tenant_of(g))
        pair.write(pages, g)
        pair.grant(pages, r, [g] * len(pages), tenant_of(r))
        rng = random.Random(data.draw(SEEDS))
        pair.read([(r, pages, [read_extent(rng, SLOTS) for _ in pages])], rng=rng)

    @rule(pool=st.sampled_from(["prefill", "decode"]), r=REQUESTS)
    def revoke(self, pool: str, r: int) -> None:
        self.pools[pool].revoke(r)

    @rule(pool=st.sampled_from(["prefill", "decode"]), data=st.data())
    def read_granted(self, pool: str, data: st.DataObject) -> None:
        """Readers read their granted pages (and their own): the decode of a prefix hit."""
        pair = self.pools[pool]
        rng = random.Random(data.draw(SEEDS))
        model = pair.model
        by_reader: dict[int, list[int]] = {}
        for r, p in model.grants:
            by_reader.setdefault(r, []).append(p)
        tables: list[Table] = []
        for r, granted in by_reader.items():
            table = granted + [p for p in model.owned_by(r) if p not in granted]
            uptos = [read_extent(rng, model.pages[p].filled) for p in table]
            tables.append((r, table, uptos))
        if tables:
            pair.read(tables, rng=rng)

    @rule(forward=st.booleans(), r=REQUESTS, data=st.data())
    def transfer(self, forward: bool, r: int, data: st.DataObject) -> None:
        src, dst = self.pools["prefill"], self.pools["decode"]
        if not forward:
            src, dst = dst, src
        src_pool = src.model.owned_by(r) if data.draw(st.booleans()) else list(range(src.model.n))
        dst_pool = dst.model.owned_by(r) if data.draw(st.booleans()) else list(range(dst.model.n))
        s = some(data, src_pool)
        d = some(data, dst_pool)
        n = min(len(s), len(d))
        src.transfer(s[:n], dst, d[:n], r)

    @invariant()
    def ledger_matches_model(self) -> None:
        for pair in self.pools.values():
            pair.check()


BUG_KINDS = ["skip_write", "placeholder", "early_free", "drop_transfer", "read_foreign"]


@dataclass
class Req:
    handle: int
    tenant: int
    table: list[int]  # decode block table
    length: int  # positions decode trusts: the next token's position
    bugs: frozenset[str]
    early_freed: set[int] = field(default_factory=set)


class EngineMachine(RuleBasedStateMachine):
    """A disaggregated engine (prefill pool -> transfer -> decode pool) driving the ledger,
    slot by slot: prefill writes a prompt of ``length`` tokens (the last page partly), decode
    appends one token per step and reads every slot up to it.

    Without bugs, no read may be flagged. With bugs (skipped writes, the legacy placeholder
    prefill of one token for a long prompt, early frees, dropped transfers, reads of other
    requests' pages), the ledger must flag exactly what the model flags, and the model
    exactly the reads of slots their reader did not write (this engine appends in order)."""

    DEVICE = "cpu"
    BUGS = False

    def __init__(self) -> None:
        super().__init__()
        self.pre = Pair(8, "prefill", self.DEVICE)
        self.dec = Pair(12, "decode", self.DEVICE)
        self.live: dict[int, Req] = {}
        self.zeroize = False
        self.flagged = 0

    @initialize(zeroize=st.booleans())
    def configure(self, zeroize: bool) -> None:
        self.zeroize = zeroize

    def _take(self, pair: Pair, n: int, data: st.DataObject) -> list[int] | None:
        free = pair.model.free_pages()
        if len(free) < n:
            return None
        return random.Random(data.draw(SEEDS)).sample(free, n)

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        handles = [h for h in range(8) if h not in self.live]
        if not handles:
            return
        h = random.Random(data.draw(SEEDS)).choice(handles)
        tenant = h % 3
        n = data.draw(st.integers(1, 3))
        length = data.draw(st.integers((n - 1) * SLOTS + 1, n * SLOTS))
        bugs = (
            frozenset(data.draw(st.sets(st.sampled_from(BUG_KINDS)))) if self.BUGS else frozenset()
        )
        p_pages = self._take(self.pre, n, data)
        d_pages = self._take(self.dec, n, data)
        if p_pages is None or d_pages is None:
            return  # no room: queued (nothing touched)
        self.pre.alloc(p_pages, h, tenant)
        if "placeholder" in bugs:  # one token into the first page; decode trusts `length`
            self.pre.write(p_pages[:1], h, 0, 1)
        else:
            ends = [SLOTS] * (n - 1) + [length - (n - 1) * SLOTS]
            written = list(range(n))
            if "skip_write" in bugs:
                written = some(data, written, n - 1)
            self.pre.write([p_pages[i] for i in written], h, 0, [ends[i] for i in written])
        self.dec.alloc(d_pages, h, tenant)
        if "drop_transfer" in bugs:
            k = data.draw(st.integers(0, n - 1))
            self.pre.transfer(p_pages[:k], self.dec, d_pages[:k], h)
        else:
            self.pre.transfer(p_pages, self.dec, d_pages, h)
        self.pre.free(p_pages, self.zeroize)
        self.live[h] = Req(h, tenant, d_pages, length, bugs)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def decode_step(self, data: st.DataObject) -> None:
        rng = random.Random(data.draw(SEEDS))
        batch = rng.sample(sorted(self.live), rng.randint(1, len(self.live)))
        stepping = []
        for h in batch:
            req = self.live[h]
            if req.length == len(req.table) * SLOTS:
                new = self._take(self.dec, 1, data)
                if new is None:
                    continue  # preempted this step
                self.dec.alloc(new, h, req.tenant)
                req.table = req.table + new
            stepping.append(req)
        # one token per request, one batched write, at each request's position
        self.dec.write(
            [req.table[req.length // SLOTS] for req in stepping],
            [req.handle for req in stepping],
            [req.length % SLOTS for req in stepping],
            [req.length % SLOTS + 1 for req in stepping],
        )
        tables: list[Table] = []
        for req in stepping:
            last = req.length // SLOTS
            table = req.table[: last + 1]
            uptos = [SLOTS] * last + [req.length % SLOTS + 1]
            if "read_foreign" in req.bugs and data.draw(st.booleans()):
                table.append(data.draw(st.integers(0, self.dec.model.n - 1)))
                uptos.append(rng.randint(1, SLOTS))
            tables.append((req.handle, table, uptos))
            req.length += 1
        if tables:
            same_len = len({len(t) for _, t, _ in tables}) == 1
            as_2d = same_len and data.draw(st.booleans())
            flagged = self.dec.read(tables, as_2d=as_2d, exact=True, rng=rng)
            self.flagged += sum(flagged.values())
            if not self.BUGS:
                assert not flagged, "a bug-free engine must never be flagged"
        for h in batch:
            req = self.live[h]
            still_owned = [p for p in req.table if p not in req.early_freed]
            if "early_free" in req.bugs and len(still_owned) > 1 and data.draw(st.booleans()):
                # frees a page still in the block table: the next step reads it
                victim = still_owned[0]
                self.dec.free([victim], self.zeroize)
                req.early_freed.add(victim)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        h = random.Random(data.draw(SEEDS)).choice(sorted(self.live))
        req = self.live.pop(h)
        self.dec.free([p for p in req.table if p not in req.early_freed], self.zeroize)

    @invariant()
    def ledger_matches_model(self) -> None:
        self.pre.check()
        self.dec.check()


class BuggyEngineMachine(EngineMachine):
    BUGS = True


FAST = settings(
    max_examples=200,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
ON_CUDA = settings(FAST, max_examples=25)

TestLedgerOps = LedgerMachine.TestCase
TestLedgerOps.settings = FAST
TestBugFreeEngine = EngineMachine.TestCase
TestBugFreeEngine.settings = settings(FAST, max_examples=100)
TestBuggyEngine = BuggyEngineMachine.TestCase
TestBuggyEngine.settings = FAST


class LedgerMachineCuda(LedgerMachine):
    DEVICE = "cuda"


class BuggyEngineMachineCuda(BuggyEngineMachine):
    DEVICE = "cuda"


@needs_cuda
class TestLedgerOpsCuda(LedgerMachineCuda.TestCase):
    settings = ON_CUDA


@needs_cuda
class TestBuggyEngineCuda(BuggyEngineMachineCuda.TestCase):
    settings = ON_CUDA


# ------------------------------------------- deferred operations (a host-side engine's)


@pytest.mark.parametrize("seed", range(80))
def test_pending_ops_flushed_leave_the_ledger_as_applying_each_op_in_turn(seed: int) -> None:
    """``PendingLedgerOps``' layering and merging against the ledger applied op by op:
    random allocations (double ones too), owner's and foreign writes, appends, holes and
    rewrites, flushed at random points; same state, same reuse counts."""
    from engine_probe.adapters.ledger_ops import PendingLedgerOps

    rng = random.Random(seed)
    pages, ps = 6, 8
    direct, deferred = PageLedger(pages, page_size=ps), PageLedger(pages, page_size=ps)
    ops = PendingLedgerOps(deferred)
    want = torch.zeros(3, dtype=torch.long)
    got = torch.zeros(3, dtype=torch.long)
    tenants = {r: r % 3 for r in range(5)}
    fill = [0] * pages  # a writer's next slot per page, so that appends are common
    for _ in range(rng.randint(1, 60)):
        roll = rng.random()
        if roll < 0.25:
            chosen = rng.sample(range(pages), rng.randint(1, 3))
            r = rng.randrange(5)
            want += direct.alloc_counts(ids(*chosen), r, tenants[r])
            ops.alloc(chosen, r, tenants[r])
            for p in chosen:
                fill[p] = 0
        elif roll < 0.9:
            p, r = rng.randrange(pages), rng.randrange(5)
            # mostly appends, sometimes a hole or a rewrite
            lo = fill[p] if rng.random() < 0.7 and fill[p] < ps else rng.randrange(ps)
            hi = rng.randint(lo + 1, min(lo + 3, ps))
            fill[p] = hi
            direct.write(ids(p), r, start=lo, end=hi, tenant=tenants[r])
            ops.write(p, r, lo, hi, tenants[r])
        else:
            counts = ops.flush()
            if counts is not None:
                got += counts
            assert deferred.snapshot() == direct.snapshot()
    counts = ops.flush()
    if counts is not None:
        got += counts
    assert ops.pending == 0 and ops.flush() is None
    assert deferred.snapshot() == direct.snapshot()
    assert got.tolist() == want.tolist()
    assert deferred.check_invariants() == []
