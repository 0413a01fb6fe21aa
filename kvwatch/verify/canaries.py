"""Synthetic prompt text, the tenants' canaries, and the leak matcher.

Every prompt a tenant sends is a prefix of one text: its canary repeated, separated by
spaces (``KVW-<hex> KVW-<hex> ...``). So every request plants the tenant's canary throughout
the KV pages it fills, and any stretch of a stale page read back by another tenant carries
it; a longer prompt is the shorter one extended (prefix-stable), so its token count never
shrinks as the byte length grows, which the bisection relies on. The text is ASCII, so bytes
and characters are the same count.

A leak is a fragment of at least ``min_fragment`` characters of one tenant's canary in the
text another tenant got back. Canaries are drawn so that no two tenants share a fragment of
that length: a match names its owner unambiguously.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

PREFIX: Final = "KVW-"
#: Shortest canary; long enough that a 64-character read holds a whole one.
MIN_CANARY_CHARS: Final = 28
SEPARATOR: Final = " "
#: Fragments shorter than this would be mostly the shared prefix: too weak to name an owner.
MIN_FRAGMENT_FLOOR: Final = 8
MIN_FRAGMENT_CEILING: Final = 64


def canary_length(min_fragment: int) -> int:
    """Characters of each canary: room for the fragment plus random characters around it."""
    return max(MIN_CANARY_CHARS, min_fragment + 8)


def _new_canary(length: int) -> str:
    hex_chars = length - len(PREFIX)
    return PREFIX + secrets.token_hex((hex_chars + 1) // 2)[:hex_chars]


def _fragments(canary: str, k: int) -> set[str]:
    return {canary[i : i + k] for i in range(len(canary) - k + 1)}


def new_canaries(tenants: Iterable[str], min_fragment: int) -> dict[str, str]:
    """One random canary per tenant, no ``min_fragment``-character fragment shared by two."""
    length = canary_length(min_fragment)
    out: dict[str, str] = {}
    taken: set[str] = set()
    for tenant in tenants:
        while True:
            canary = _new_canary(length)
            frags = _fragments(canary, min_fragment)
            if not frags & taken:
                break
        taken |= frags
        out[tenant] = canary
    return out


class TenantText:
    """The synthetic prompt text of one tenant: its canary, repeated."""

    def __init__(self, canary: str) -> None:
        self.canary = canary
        self._unit = canary + SEPARATOR

    def text(self, n_bytes: int) -> str:
        """The first ``n_bytes`` characters (= UTF-8 bytes) of the tenant's text."""
        if n_bytes < 1:
            raise ValueError(f"a prompt needs at least one byte, not {n_bytes}")
        reps = -(-n_bytes // len(self._unit))
        return (self._unit * reps)[:n_bytes]

    @property
    def period(self) -> int:
        """Characters after which the text repeats."""
        return len(self._unit)


@dataclass(frozen=True)
class CanaryMatch:
    owner: str
    canary: str
    #: The longest stretch of the canary found (canary characters only).
    fragment: str


class LeakMatcher:
    """Finds other tenants' canary fragments in a text."""

    def __init__(self, canaries: dict[str, str], min_fragment: int) -> None:
        if min_fragment < 1:
            raise ValueError("min_fragment must be positive")
        self.canaries = dict(canaries)
        self.k = min_fragment
        # fragment -> (owner, offset in the canary); new_canaries keeps fragments unique
        self._index: dict[str, tuple[str, int]] = {}
        for owner, canary in canaries.items():
            if len(canary) < min_fragment:
                raise ValueError(f"{owner}'s canary is shorter than min_fragment")
            for i in range(len(canary) - min_fragment + 1):
                self._index.setdefault(canary[i : i + min_fragment], (owner, i))

    def find(self, reader: str, text: str) -> list[CanaryMatch]:
        """Canaries of tenants other than ``reader`` with a fragment in ``text``: one match
        per owner, its longest fragment."""
        k = self.k
        best: dict[str, str] = {}
        i = 0
        while i <= len(text) - k:
            hit = self._index.get(text[i : i + k])
            if hit is None or hit[0] == reader:
                i += 1
                continue
            owner, j = hit
            canary = self.canaries[owner]
            n = k
            while i + n < len(text) and j + n < len(canary) and text[i + n] == canary[j + n]:
                n += 1
            fragment = canary[j : j + n]
            if len(fragment) > len(best.get(owner, "")):
                best[owner] = fragment
            i += n - k + 1
        return [CanaryMatch(o, self.canaries[o], f) for o, f in sorted(best.items())]
