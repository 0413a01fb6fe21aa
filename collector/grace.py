"""How long a replaced secret keeps working after a rotation: a machine token's old secret
(``kvwatch tokens rotate``) and a webhook's old signing secret (``kvwatch webhooks
rotate-secret``) share one default and one bound, so the two rotations read alike."""

from __future__ import annotations

from collector.errors import InvalidInput

DEFAULT_GRACE_S = 24 * 3600  # long enough for a day's reconfiguration, short for a leak
MAX_GRACE_S = 30 * 24 * 3600  # a replaced secret left working longer is a leak kept open


def checked_grace(grace_s: float) -> float:
    """``grace_s`` if it lies within 0 to :data:`MAX_GRACE_S`; else :class:`InvalidInput`
    naming ``grace`` (infinity included)."""
    if not 0 <= grace_s <= MAX_GRACE_S:
        raise InvalidInput(
            f"grace must be between 0 and {MAX_GRACE_S // 86_400} days, "
            f"not {grace_s / 86_400:.4g} days",
            {"field": "grace"},
        )
    return grace_s
