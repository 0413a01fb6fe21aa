"""The rule kinds, by name. Kinds are code; rule packs choose and parameterise them."""

from __future__ import annotations

from policies.kinds.advisory import EngineVersionAdvisory
from policies.kinds.base import RuleKind
from policies.kinds.bus import BusLag
from policies.kinds.context import ContextPressure
from policies.kinds.isolation import RejectedPrefillKvTransfer, StalePageRead
from policies.kinds.pool import PoolBelowAdvertised, PoolHeadroom
from policies.kinds.prefix import PrefixCacheCrossTenant, PrefixCacheUnsalted, PrefixProbeSuspected
from policies.kinds.telemetry import TelemetryGap
from policies.kinds.verification import (
    ConfigDrift,
    VerificationFailed,
    VerificationMissingOrStale,
)

KINDS: dict[str, RuleKind] = {
    k.name: k
    for k in (
        ContextPressure(),
        PoolBelowAdvertised(),
        PoolHeadroom(),
        VerificationMissingOrStale(),
        VerificationFailed(),
        ConfigDrift(),
        StalePageRead(),
        RejectedPrefillKvTransfer(),
        EngineVersionAdvisory(),
        PrefixCacheUnsalted(),
        PrefixCacheCrossTenant(),
        PrefixProbeSuspected(),
        TelemetryGap(),
        BusLag(),
    )
}

__all__ = ["KINDS", "RuleKind"]
