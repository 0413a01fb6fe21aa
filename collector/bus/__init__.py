"""The ingest bus: accepted batches go through a replicated NATS JetStream stream between the
collectors that accept them and the writers that store them (docs/scaling.md).

- :mod:`collector.bus.layout`: the stream, its partitions and their consumers, by name;
- :mod:`collector.bus.envelope`: what a message carries (the batch as received, and who sent
  it);
- :mod:`collector.bus.connection`: connecting with the settings' credentials, and the stream;
- :mod:`collector.bus.publisher`: the collector's side (publish, answer after the ack);
- :mod:`collector.bus.writer`: ``kvwatch writer`` (fetch, store, ack after commit);
- :mod:`collector.bus.monitor`: the stream's state (pending, redeliveries, lag), for
  ``kvwatch bus status``, ``/metrics``, ``/readyz`` and the ``bus_lag`` rule.

Errors: what the bus refuses at ingest is :class:`collector.errors.BusUnavailable` (or
:class:`~collector.errors.BusFull`), a 503 with ``Retry-After``.
"""
