"""Monthly range partitions (PostgreSQL) of the big tables.

``pool_samples`` and ``page_events`` are partitioned by ``ts``, ``requests`` by ``part_ts``
(µs since the epoch, UTC months): ``<table>_p_before`` holds everything before the first
month, ``<table>_pYYYY_MM`` one month each, ``<table>_default`` anything else.
:func:`ensure` keeps the current month and the next ``MONTHS_AHEAD`` in place (the
collector runs it at start and hourly), moving any rows the default partition holds for a
month it creates; retention drops whole months (:func:`drop_before`). Queries that bound
the key are pruned to the months they touch.

Requests: PostgreSQL requires the partition key in every unique index, and their upsert key
(deployment_id, request_id) holds no time. So a request's month is fixed when it is first
stored (``part_ts``, its first_ts then; first_ts itself may move earlier later), the unique
index is (deployment_id, request_id, part_ts), and ``request_keys`` maps each key to its
``part_ts`` (see :class:`collector.models.RequestKey`). SQLite has no partitioning;
everything here is a no-op there.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Connection, text

from collector.timefmt import to_micros

#: partitioned table -> its partition key column
KEYS = {"pool_samples": "ts", "page_events": "ts", "requests": "part_ts"}
PARTITIONED = tuple(KEYS)
#: the unique index each table has on PostgreSQL instead of the models' (key, no time)
PG_UNIQUE = {
    "requests": ("uq_requests_deployment_id_part_ts", "deployment_id, request_id, part_ts")
}
MONTHS_AHEAD = 3
_LOCK = 0x6B7677_0003  # one partition maintainer at a time across replicas
_CHILD = re.compile(rf"^({'|'.join(PARTITIONED)})_(p\d{{4}}_\d{{2}}|p_before|default)$")
_BOUND = re.compile(r"FROM \((MINVALUE|'?-?\d+'?)\) TO \((MAXVALUE|'?-?\d+'?)\)")


def is_partition(name: str) -> bool:
    """A child partition table (migrations and schema comparison leave them alone)."""
    return _CHILD.match(name) is not None


def pg_only(dialect: str, type_: str, name: str | None, obj: object = None) -> bool:
    """Schema objects that exist only because of partitioning, or differ for it on
    PostgreSQL (the models describe the plain tables): migrations and schema comparison
    leave them alone."""
    if type_ == "table":
        return name is not None and is_partition(name)
    if dialect != "postgresql" or type_ not in ("unique_constraint", "index"):
        return False
    table = getattr(getattr(obj, "table", None), "name", None)
    is_unique = type_ == "unique_constraint" or bool(getattr(obj, "unique", False))
    return is_unique and table in PG_UNIQUE


def month_start(dt: datetime) -> datetime:
    return datetime(dt.year, dt.month, 1, tzinfo=UTC)


def next_month(dt: datetime) -> datetime:
    return datetime(dt.year + (dt.month == 12), dt.month % 12 + 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Partition:
    name: str
    lo: int | None  # µs, None: MINVALUE
    hi: int | None  # µs, None: MAXVALUE / default
    default: bool = False


def _bound(raw: str) -> int | None:
    return None if raw in ("MINVALUE", "MAXVALUE") else int(raw.strip("'"))


def partitions(conn: Connection, table: str) -> list[Partition]:
    rows = conn.execute(
        text(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent "
            "WHERE p.relname = :t ORDER BY c.relname"
        ),
        {"t": table},
    ).all()
    out = []
    for name, bound in rows:
        if bound == "DEFAULT":
            out.append(Partition(name, None, None, default=True))
            continue
        mt = _BOUND.search(bound)
        if mt is None:  # pragma: no cover - only range partitions are created here
            raise RuntimeError(f"unexpected partition bound of {name}: {bound}")
        out.append(Partition(name, _bound(mt.group(1)), _bound(mt.group(2))))
    return sorted(out, key=lambda p: (p.default, -(2**63) if p.lo is None else p.lo))


def is_partitioned(conn: Connection, table: str) -> bool:
    if conn.dialect.name != "postgresql":
        return False
    return bool(
        conn.execute(
            text(
                "SELECT count(*) FROM pg_partitioned_table pt JOIN pg_class c ON "
                "c.oid = pt.partrelid WHERE c.relname = :t"
            ),
            {"t": table},
        ).scalar_one()
    )


def _create_month(conn: Connection, table: str, month: datetime, default: str | None) -> str:
    lo, hi = to_micros(month), to_micros(next_month(month))
    name = f"{table}_p{month.year:04d}_{month.month:02d}"
    conn.execute(text(f'CREATE TABLE "{name}" (LIKE "{table}" INCLUDING DEFAULTS)'))
    if default is not None:
        # Rows that arrived before their month existed: move them, or ATTACH would fail.
        conn.execute(
            text(
                f'WITH moved AS (DELETE FROM "{default}" WHERE {KEYS[table]} >= :lo AND '
                f'{KEYS[table]} < :hi RETURNING *) INSERT INTO "{name}" SELECT * FROM moved'
            ),
            {"lo": lo, "hi": hi},
        )
    conn.execute(
        text(f'ALTER TABLE "{table}" ATTACH PARTITION "{name}" FOR VALUES FROM ({lo}) TO ({hi})')
    )
    return name


def ensure(conn: Connection, now: datetime) -> list[str]:
    """Create the months from ``now``'s to ``MONTHS_AHEAD`` later that are missing, in the
    caller's transaction; returns their names."""
    if conn.dialect.name != "postgresql":
        return []
    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _LOCK})
    created = []
    for table in PARTITIONED:
        if not is_partitioned(conn, table):
            continue
        have = partitions(conn, table)
        default = next((p.name for p in have if p.default), None)
        covered = [(p.lo, p.hi) for p in have if not p.default]
        month = month_start(now)
        for _ in range(MONTHS_AHEAD + 1):
            lo, hi = to_micros(month), to_micros(next_month(month))
            overlaps = any((a is None or a < hi) and (b is None or b > lo) for a, b in covered)
            if not overlaps:
                created.append(_create_month(conn, table, month, default))
                covered.append((lo, hi))
            month = next_month(month)
    return created


def convert(conn: Connection, table: str, now: datetime) -> None:
    """Turn an existing plain ``table`` into a partitioned one, keeping its rows, indexes and
    id sequence (used by migration 0007). The months run from the oldest row's (or now's)
    to ``MONTHS_AHEAD`` ahead; older rows cannot exist, so ``_p_before`` starts empty."""
    old = f"{table}_unpartitioned"
    key = KEYS[table]
    first = conn.execute(text(f'SELECT min({key}) FROM "{table}"')).scalar()
    start = month_start(datetime.fromtimestamp(first / 1e6, UTC) if first is not None else now)
    indexes = conn.execute(
        text("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = :t"), {"t": table}
    ).all()
    conn.execute(text(f'ALTER TABLE "{table}" RENAME TO "{old}"'))
    for name, _ in indexes:
        conn.execute(text(f'ALTER INDEX "{name}" RENAME TO "{name}_unpartitioned"'))
    conn.execute(
        text(f'CREATE TABLE "{table}" (LIKE "{old}" INCLUDING DEFAULTS) PARTITION BY RANGE ({key})')
    )
    # The partition key must be in the primary key, and in every unique index.
    conn.execute(text(f'ALTER TABLE "{table}" ADD CONSTRAINT "pk_{table}" PRIMARY KEY (id, {key})'))
    for name, ddl in indexes:
        if name == f"pk_{table}":
            continue
        if " UNIQUE " in ddl:
            uq, cols = PG_UNIQUE[table]
            conn.execute(text(f'CREATE UNIQUE INDEX "{uq}" ON "{table}" ({cols})'))
            continue
        conn.execute(text(ddl.replace(f"ON public.{table} ", f'ON "{table}" ')))
    conn.execute(
        text(
            f'CREATE TABLE "{table}_p_before" PARTITION OF "{table}" '
            f"FOR VALUES FROM (MINVALUE) TO ({to_micros(start)})"
        )
    )
    conn.execute(text(f'CREATE TABLE "{table}_default" PARTITION OF "{table}" DEFAULT'))
    month = start
    last = month_start(now)
    for _ in range(MONTHS_AHEAD):
        last = next_month(last)
    while month <= last:
        _create_month(conn, table, month, None)
        month = next_month(month)
    conn.execute(text(f'INSERT INTO "{table}" SELECT * FROM "{old}"'))
    conn.execute(text(f'ALTER SEQUENCE "{table}_id_seq" OWNED BY "{table}".id'))
    conn.execute(text(f'DROP TABLE "{old}"'))


def unconvert(conn: Connection, table: str) -> None:
    """The reverse of :func:`convert` (the migration's downgrade)."""
    old = f"{table}_partitioned"
    conn.execute(text(f'ALTER TABLE "{table}" RENAME TO "{old}"'))
    indexes = conn.execute(
        text("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = :t"), {"t": old}
    ).all()
    for name, _ in indexes:
        conn.execute(text(f'ALTER INDEX "{name}" RENAME TO "{name}_partitioned"'))
    conn.execute(text(f'CREATE TABLE "{table}" (LIKE "{old}" INCLUDING DEFAULTS)'))
    conn.execute(text(f'ALTER TABLE "{table}" ADD CONSTRAINT "pk_{table}" PRIMARY KEY (id)'))
    for name, ddl in indexes:
        if name == f"pk_{table}":
            continue
        if table in PG_UNIQUE and name == PG_UNIQUE[table][0]:
            conn.execute(
                text(
                    f'ALTER TABLE "{table}" ADD CONSTRAINT "uq_{table}_deployment_id" '
                    "UNIQUE (deployment_id, request_id)"
                )
            )
            continue
        conn.execute(text(ddl.replace(f"ON ONLY public.{old} ", f'ON "{table}" ')
                          .replace(f"ON public.{old} ", f'ON "{table}" ')))  # fmt: skip
    conn.execute(text(f'INSERT INTO "{table}" SELECT * FROM "{old}"'))
    conn.execute(text(f'ALTER SEQUENCE "{table}_id_seq" OWNED BY "{table}".id'))
    conn.execute(text(f'DROP TABLE "{old}" CASCADE'))


def drop_before(
    conn: Connection,
    table: str,
    before_us: int,
    *,
    dry_run: bool = False,
    keep: Callable[[Connection, Partition], bool] | None = None,
) -> tuple[dict[str, int], list[Partition]]:
    """Drop every month that ends at or before ``before_us`` (and that ``keep`` does not
    hold back); returns rows per deployment that went with them (counted first) and the
    months dropped."""
    gone: dict[str, int] = {}
    dropped: list[Partition] = []
    if not is_partitioned(conn, table):
        return gone, dropped
    for p in partitions(conn, table):
        if p.default or p.hi is None or p.hi > before_us:
            continue
        if keep is not None and keep(conn, p):
            continue
        for dep, n in conn.execute(
            text(f'SELECT deployment_id, count(*) FROM "{p.name}" GROUP BY deployment_id')
        ):
            gone[dep] = gone.get(dep, 0) + int(n)
        dropped.append(p)
        if not dry_run:
            if table == "requests":  # their keys go with them
                conn.execute(
                    text("DELETE FROM request_keys WHERE part_ts >= :lo AND part_ts < :hi"),
                    {"lo": -(2**63) if p.lo is None else p.lo, "hi": p.hi},
                )
            conn.execute(text(f'DROP TABLE "{p.name}"'))
    return gone, dropped
