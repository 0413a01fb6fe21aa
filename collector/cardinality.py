"""Limits on new names: the deployments, nodes, models, routes and probe ids one token (its
rotation lineage) may introduce per hour. A batch is the unit: if the new names it carries
would take its token over a limit, the whole batch is refused with 429 naming the limit, and
nothing is stored (a probe retries it later; the window slides). Names already known cost nothing.

Invariant: every (kind, deployment, value) a stored event carries has a row in
``label_values`` (written in the batch's own transaction), so "new" is decided against the
database, the same on every replica. A process-local set of known names spares the query for
names seen before; it only ever says "known" for names with a row.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter

from sqlalchemy import Connection, func, select, tuple_
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from collector import models as m
from collector.errors import TooManyNewNames
from engine_probe import events as ev

KINDS = ("deployment", "node", "model", "route", "probe")
HOUR_US = 3_600_000_000
_KNOWN_MAX = 200_000  # names remembered per process before the set starts over

Name = tuple[str, str, str]  # (kind, deployment_id, value)


@dataclass(frozen=True, slots=True)
class Limits:
    """New names per token lineage per hour, by kind (``KVWATCH_MAX_NEW_*_PER_HOUR``)."""

    deployment: int
    node: int
    model: int
    route: int
    probe: int = 300

    def of(self, kind: str) -> int:
        return int(getattr(self, kind))


def names_of(events: Iterable[ev.Event]) -> set[Name]:
    """Every (kind, deployment, value) a batch names."""
    # A batch's events repeat a few label tuples: collect the distinct ones at C speed (one
    # getter per event type, made at import), then spell out their names.
    seen = {(type(e), _LABEL_GET[type(e)](e)) for e in events}
    out: set[Name] = set()
    for t, got in seen:
        fields = _LABEL_FIELDS[t]
        labels = dict(zip(fields, got if len(fields) > 1 else (got,), strict=True))
        dep = labels["deployment_id"]
        out.add(("deployment", dep, dep))
        for field, kind in _LABEL_KINDS:
            if value := labels.get(field):
                out.add((kind, dep, value))
    # a probe id is a name too: each new one is a row, a gap record and alert labels
    out |= {("probe", e.deployment_id, e.probe_id) for e in events}
    return out


_LABEL_KINDS = (("node", "node"), ("model_id", "model"), ("route", "route"))
# Per event type: the label fields it has (deployment_id first), and a getter of them.
_LABEL_FIELDS = {
    t: ("deployment_id", *(f for f, _ in _LABEL_KINDS if f in t.__struct_fields__))
    for t in ev.EVENT_TYPES
}
_LABEL_GET = {t: attrgetter(*fields) for t, fields in _LABEL_FIELDS.items()}


class NewNames:
    def __init__(self, limits: Limits):
        self.limits = limits
        self._known: set[Name] = set()

    def admit(
        self,
        conn: Connection,
        lineage: int,
        events: Sequence[ev.Event],
        now_us: int,
        names: set[Name] | None = None,
    ) -> None:
        """Record the batch's new names for ``lineage``, or raise :class:`TooManyNewNames`
        (inside the caller's transaction, before anything of the batch is written).
        ``names``: ``names_of(events)``, when the caller has it already."""
        wanted = self.unknown(names_of(events) if names is None else names)
        if not wanted:
            return
        lv = m.LabelValue
        have = self._stored(conn, wanted)
        new = wanted - have
        if new:
            self._check(conn, lineage, new, now_us)
            # Two replicas may add the same name at once: the second insert is a no-op.
            upsert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
            conn.execute(
                upsert(lv).on_conflict_do_nothing(),
                [
                    {
                        "kind": k,
                        "deployment_id": d,
                        "value": v,
                        "token_lineage": lineage,
                        "first_seen": now_us,
                    }
                    for k, d, v in sorted(new)
                ],
            )
        # Only names already committed by someone are remembered here; this batch's own may
        # still roll back, and are learnt again from the table next time.
        self._remember(have)

    def check(self, conn: Connection, lineage: int, names: set[Name], now_us: int) -> None:
        """What :meth:`admit` would decide, recording nothing: raises
        :class:`TooManyNewNames` when the batch's new names would pass the limits. The
        ingest bus asks before publishing, so a batch over them is answered 429 (and kept by
        its probe) as direct ingest answers it; the writer's :meth:`admit` stays the rule."""
        wanted = self.unknown(names)
        if not wanted:
            return
        have = self._stored(conn, wanted)
        if wanted - have:
            self._check(conn, lineage, wanted - have, now_us)
        self._remember(have)

    def unknown(self, names: set[Name]) -> set[Name]:
        """The names not known to be stored already (those need a look at the table)."""
        return names - self._known

    def _remember(self, have: set[Name]) -> None:
        if len(self._known) > _KNOWN_MAX:
            self._known.clear()
        self._known |= have

    def _stored(self, conn: Connection, wanted: set[Name]) -> set[Name]:
        lv = m.LabelValue
        return {
            (k, d, v)
            for k, d, v in conn.execute(
                select(lv.kind, lv.deployment_id, lv.value).where(
                    tuple_(lv.kind, lv.deployment_id, lv.value).in_(sorted(wanted))
                )
            )
        }

    def _check(self, conn: Connection, lineage: int, new: set[Name], now_us: int) -> None:
        lv = m.LabelValue
        counts = dict(
            conn.execute(
                select(lv.kind, func.count())
                .where(lv.token_lineage == lineage, lv.first_seen > now_us - HOUR_US)
                .group_by(lv.kind)
            ).all()
        )
        for kind in KINDS:
            adding = sum(1 for k, _, _ in new if k == kind)
            if not adding:
                continue
            limit = self.limits.of(kind)
            had = int(counts.get(kind, 0))
            if had + adding > limit:
                env = f"KVWATCH_MAX_NEW_{kind.upper()}S_PER_HOUR"
                raise TooManyNewNames(
                    f"this token named {had} new {kind}s in the last hour and the batch adds "
                    f"{adding}: over the limit of {limit} per hour ({env}); nothing was "
                    "stored, retry later or ask an operator to raise it",
                    {"kind": kind, "limit_per_hour": limit, "in_last_hour": had,
                     "in_batch": adding, "setting": env},
                )  # fmt: skip
