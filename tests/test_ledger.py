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
    assert snap["writer_request"] == [-1] * 8
    assert snap["valid_for"] == [-1] * 8


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


def test_partial_writes_validate_nothing() -> None:
    led = PageLedger(8)
    led.alloc(ids(0), 1, 10)
    led.write(ids(0), 1)
    led.free(ids(0))
    led.alloc(ids(0, 1), 2, 20)
    led.write(ids(0, 1), 2, partial=True)  # appending a token to a stale page heals nothing
    stale = led.read(ids(0, 1), 2)
    assert [(s.page_ids, s.previous_request) for s in stale] == [([1], None), ([0], 1)]
    led.write(ids(1), 2)
    led.write(ids(1), 2, partial=True)  # appending to one's own valid page keeps it valid
    assert led.read(ids(1), 2) == []
    led.alloc(ids(2), 3, 30)
    led.write(ids(1), 3, partial=True)  # another request appending spoils it for the owner
    (stale,) = led.read(ids(1), 2)
    assert (stale.previous_request, stale.previous_tenant) == (3, 30)
    assert led.check_invariants() == []


def test_batched_write_one_writer_per_page() -> None:
    led = PageLedger(8)
    for r in range(3):
        led.alloc(ids(r), r, 10 + r)
    led.write(ids(0, 1), ids(0, 1))
    # a decode step: request 0 appends to page 0, 1 to page 1, 2 starts page 2
    led.write(ids(0, 1, 2), ids(0, 1, 2), partial=torch.tensor([True, True, False]))
    assert led.read(ids(0, 1, 2), ids(0, 1, 2)) == []
    led.write(ids(2), ids(1), partial=torch.tensor([True]))  # request 1 spoils request 2's page
    (stale,) = led.read(ids(0, 1, 2), ids(0, 1, 2))
    assert (stale.reader_request, stale.previous_request, stale.previous_tenant) == (2, 1, -1)
    led.write(ids(2), ids(1), tenant=ids(11))  # tenant given: named
    (stale,) = led.read(ids(2), 2)
    assert (stale.previous_request, stale.previous_tenant) == (1, 11)
    with pytest.raises(ValueError, match="broadcast"):
        led.write(ids(0, 1), ids(0, 1, 2))
    assert led.check_invariants() == []


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
    pre.write(ids(0, device=device), b)
    dec.alloc(ids(4, 5, 6, device=device), b, 200)
    (t_stale,) = pre.transfer(ids(0, 1, device=device), dec, ids(4, 5, device=device), b)
    assert (t_stale.read_kind, t_stale.page_ids, t_stale.previous_tenant) == ("transfer", [1], 100)
    reads = dec.read(ids(4, 5, 6, device=device).view(1, 3), ids(b, device=device).view(1, 1))
    got = {
        (tuple(s.page_ids), s.previous_request, s.previous_tenant, s.cross_tenant) for s in reads
    }
    assert got == {((5, 6), a, 100, True)}
    assert pre.check_invariants() == [] and dec.check_invariants() == []


@needs_cuda
def test_transfer_across_devices() -> None:
    pre, dec = PageLedger(4, device="cpu"), PageLedger(4, device="cuda")
    pre.alloc([0, 1], 1, 10)
    pre.write([0], 1)
    dec.alloc([2, 3], 1, 10)
    assert [s.page_ids for s in pre.transfer([0, 1], dec, [2, 3], 1)] == [[1]]
    assert [s.page_ids for s in dec.read([2, 3], 1)] == [[3]]


# --------------------------------------------------------------------------- reference model

Report = tuple[int, int, int, int | None, int | None, bool, str, str]


@dataclass
class RefPage:
    owner: int = -1
    owner_tenant: int = -1
    gen: int = 0
    writer: int | None = None  # None: never written since the pool was created
    writer_tenant: int = -1
    written_gen: int | None = None  # None: never written, or carried in by a stale transfer
    zeroized: bool = False


@dataclass
class RefPool:
    """The ledger's contract, written as plainly as possible, one page at a time."""

    n: int
    name: str
    pages: list[RefPage] = field(init=False)
    tenants: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pages = [RefPage() for _ in range(self.n)]

    def tenant_of(self, r: int) -> int:
        return self.tenants.get(r, -1)

    def owned_by(self, r: int) -> list[int]:
        return [i for i, pg in enumerate(self.pages) if pg.owner == r]

    def free_pages(self) -> list[int]:
        return [i for i, pg in enumerate(self.pages) if pg.owner == -1]

    def valid(self, p: int, r: int) -> bool:
        pg = self.pages[p]
        return pg.owner == r and pg.writer == r and pg.written_gen == pg.gen and not pg.zeroized

    def alloc(self, pages: list[int], r: int, t: int) -> ReuseStats:
        reused = cross = zeroized = 0
        for p in pages:
            pg = self.pages[p]
            holds = pg.writer is not None and not pg.zeroized
            reused += holds
            cross += holds and pg.writer_tenant != t
            zeroized += pg.zeroized
            pg.owner, pg.owner_tenant, pg.gen = r, t, pg.gen + 1
        self.tenants[r] = t
        return ReuseStats(reused, cross, zeroized)

    def write(
        self, pages: list[int], writers: list[int], partial: list[bool], known_tenant: bool
    ) -> None:
        """``known_tenant``: a single-handle write, where the ledger looks the tenant up."""
        for p, r, part in zip(pages, writers, partial, strict=True):
            pg = self.pages[p]
            if part and not (pg.owner >= 0 and pg.owner != r and self.valid(p, pg.owner)):
                continue  # a partial write only ever spoils another request's valid page
            pg.writer = r
            if pg.owner == r:
                pg.writer_tenant = pg.owner_tenant
            else:
                pg.writer_tenant = self.tenant_of(r) if known_tenant else -1
            pg.written_gen = pg.gen
            pg.zeroized = False

    def free(self, pages: list[int], zeroized: bool) -> None:
        for p in pages:
            pg = self.pages[p]
            pg.owner = pg.owner_tenant = -1
            pg.zeroized = pg.zeroized or zeroized

    def stale(self, p: int, r: int, kind: str) -> Report:
        pg = self.pages[p]
        prev_tenant = None if pg.writer is None else pg.writer_tenant
        return (r, self.tenant_of(r), p, pg.writer, prev_tenant, pg.zeroized, kind, self.name)

    def read(self, pages: list[int], readers: list[int]) -> Counter[Report]:
        return Counter(
            self.stale(p, r, "decode")
            for p, r in zip(pages, readers, strict=True)
            if not self.valid(p, r)
        )

    def transfer(
        self, src: list[int], dst: RefPool, dst_pages: list[int], r: int
    ) -> Counter[Report]:
        out: Counter[Report] = Counter()
        carried = []
        for s in src:
            pg = self.pages[s]
            if self.valid(s, r):
                carried.append((r, pg.owner_tenant, True, False))
            else:
                out[self.stale(s, r, "transfer")] += 1
                carried.append((pg.writer, pg.writer_tenant, False, pg.zeroized))
        for d, (w, wt, ok, z) in zip(dst_pages, carried, strict=True):
            dp = dst.pages[d]
            dp.writer, dp.writer_tenant, dp.zeroized = w, wt, z
            dp.written_gen = dp.gen if ok else None
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


class Pair:
    """A ledger and its reference model, driven together; every outcome is compared."""

    def __init__(self, n: int, name: str, device: str) -> None:
        self.ledger = PageLedger(n, device=device, name=name)
        self.model = RefPool(n, name)
        self.device = device

    def t(self, pages: list[int]) -> torch.Tensor:
        return torch.tensor(pages, dtype=torch.long, device=self.device)

    def alloc(self, pages: list[int], r: int, tenant: int) -> None:
        assert self.ledger.alloc(self.t(pages), r, tenant) == self.model.alloc(pages, r, tenant)

    def write(
        self, pages: list[int], r: int | list[int], partial: bool | list[bool] = False
    ) -> None:
        """One writer handle or one per page; one partial flag or one per page."""
        writers = r if isinstance(r, list) else [r] * len(pages)
        parts = partial if isinstance(partial, list) else [partial] * len(pages)
        self.ledger.write(
            self.t(pages),
            self.t(r) if isinstance(r, list) else r,
            partial=torch.tensor(partial, dtype=torch.bool, device=self.device)
            if isinstance(partial, list)
            else partial,
        )
        self.model.write(pages, writers, parts, known_tenant=not isinstance(r, list))

    def free(self, pages: list[int], zeroized: bool) -> None:
        self.ledger.free(self.t(pages), zeroized=zeroized)
        self.model.free(pages, zeroized)

    def read(self, tables: list[tuple[int, list[int]]], as_2d: bool = False) -> Counter[Report]:
        pages = [p for _, table in tables for p in table]
        readers = [r for r, table in tables for _ in table]
        expected = self.model.read(pages, readers)
        if as_2d:
            got = self.ledger.read(
                self.t([table for _, table in tables]),
                self.t([r for r, _ in tables]).view(-1, 1),
            )
        elif len(tables) == 1:
            got = self.ledger.read(self.t(pages), tables[0][0])
        else:
            got = self.ledger.read(self.t(pages), self.t(readers))
        assert flatten(got) == expected
        return expected

    def transfer(self, src: list[int], dst: Pair, dst_pages: list[int], r: int) -> None:
        expected = self.model.transfer(src, dst.model, dst_pages, r)
        got = self.ledger.transfer(self.t(src), dst.ledger, dst.t(dst_pages), r)
        assert flatten(got) == expected

    def check(self) -> None:
        snap = self.ledger.snapshot()
        assert snap.pop("valid_for") == [
            pg.owner if self.model.valid(i, pg.owner) else -1
            for i, pg in enumerate(self.model.pages)
        ]
        assert snap == self.model.snapshot()
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
        partial=st.booleans(),
        data=st.data(),
    )
    def write(self, pool: str, r: int, own: bool, partial: bool, data: st.DataObject) -> None:
        pair = self.pools[pool]
        candidates = pair.model.owned_by(r) if own else list(range(pair.model.n))
        pair.write(some(data, candidates), r, partial)

    @rule(pool=st.sampled_from(["prefill", "decode"]), data=st.data())
    def write_batch(self, pool: str, data: st.DataObject) -> None:
        """One call, a writer and a partial flag per page (a decode step's writes); pages
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
        partial = [rng.random() < 0.5 for _ in pages]
        pair.write(pages, writers, partial if rng.random() < 0.7 else rng.random() < 0.5)

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
        readers = data.draw(st.lists(REQUESTS, unique=True, min_size=1, max_size=3))
        tables = []
        for r in readers:
            table = pair.model.owned_by(r)
            if data.draw(st.booleans()):  # plus pages it does not own
                table += some(data, list(range(pair.model.n)), 2)
            tables.append((r, table))
        same_len = len({len(t) for _, t in tables}) == 1
        pair.read(tables, as_2d=same_len and data.draw(st.booleans()))

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


BUG_KINDS = ["skip_write", "early_free", "drop_transfer", "read_foreign"]
SLOTS = 4  # tokens per page


@dataclass
class Req:
    handle: int
    tenant: int
    table: list[int]  # decode block table
    fill: int  # tokens in the last page
    bugs: frozenset[str]
    early_freed: set[int] = field(default_factory=set)


class EngineMachine(RuleBasedStateMachine):
    """A disaggregated engine (prefill pool -> transfer -> decode pool) driving the ledger.

    Without bugs, no read may be flagged. With bugs (skipped writes, early frees, dropped
    transfers, reads of other requests' pages), the ledger must flag exactly what the model
    flags."""

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
        bugs = (
            frozenset(data.draw(st.sets(st.sampled_from(BUG_KINDS)))) if self.BUGS else frozenset()
        )
        p_pages = self._take(self.pre, n, data)
        d_pages = self._take(self.dec, n, data)
        if p_pages is None or d_pages is None:
            return  # no room: queued (nothing touched)
        self.pre.alloc(p_pages, h, tenant)
        written = p_pages
        if "skip_write" in bugs:
            written = some(data, p_pages, n - 1)
        self.pre.write(written, h)
        self.dec.alloc(d_pages, h, tenant)
        if "drop_transfer" in bugs:
            k = data.draw(st.integers(0, n - 1))
            self.pre.transfer(p_pages[:k], self.dec, d_pages[:k], h)
        else:
            self.pre.transfer(p_pages, self.dec, d_pages, h)
        self.pre.free(p_pages, self.zeroize)
        fill = data.draw(st.integers(1, SLOTS))
        self.live[h] = Req(h, tenant, d_pages, fill, bugs)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def decode_step(self, data: st.DataObject) -> None:
        rng = random.Random(data.draw(SEEDS))
        batch = rng.sample(sorted(self.live), rng.randint(1, len(self.live)))
        stepping = []
        for h in batch:
            req = self.live[h]
            if req.fill == SLOTS:
                new = self._take(self.dec, 1, data)
                if new is None:
                    continue  # preempted this step
                self.dec.alloc(new, h, req.tenant)
                req.table = req.table + new
                req.fill = 0
            stepping.append(req)
        # one token per request, one batched write: the first token of a page covers its
        # first slot (a full write), later ones append (partial)
        self.dec.write(
            [req.table[-1] for req in stepping],
            [req.handle for req in stepping],
            [req.fill > 0 for req in stepping],
        )
        tables = []
        for req in stepping:
            h = req.handle
            req.fill += 1
            table = list(req.table)
            if "read_foreign" in req.bugs and data.draw(st.booleans()):
                table.append(data.draw(st.integers(0, self.dec.model.n - 1)))
            tables.append((h, table))
        if tables:
            same_len = len({len(t) for _, t in tables}) == 1
            flagged = self.dec.read(tables, as_2d=same_len and data.draw(st.booleans()))
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
