"""Names on the bus: the stream, its partition subjects and their durable consumers.

A deployment's batches all go to one partition (a hash of its id), so they are stored in the
order they were accepted; partitions are written independently of each other."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from collector.settings import Settings


@dataclass(frozen=True, slots=True)
class Layout:
    """Invariants: ``partitions >= 1``; ``subject(p)`` for ``0 <= p < partitions`` are the
    stream's only subjects, each filtered by exactly one consumer, ``consumer(p)`` (a work
    queue stream needs its consumers' filters disjoint, and one consumer per partition with
    one batch in flight keeps the partition in order)."""

    stream: str
    prefix: str
    partitions: int

    @classmethod
    def of(cls, settings: Settings) -> Layout:
        return cls(settings.bus_stream, settings.bus_subject, settings.bus_partitions)

    @property
    def wildcard(self) -> str:
        return f"{self.prefix}.*"

    def subject(self, partition: int) -> str:
        return f"{self.prefix}.{partition}"

    def consumer(self, partition: int) -> str:
        return f"{self.stream}-p{partition}"

    def partition_of(self, deployment_id: str) -> int:
        digest = hashlib.blake2b(deployment_id.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") % self.partitions

    def partition_of_subject(self, subject: str) -> int:
        return int(subject.rsplit(".", 1)[1])
