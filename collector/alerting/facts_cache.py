"""What the ingest path remembers between batches, so that a batch reads no more than it
must: each touched deployment's node configs and verifications (reused for ``ttl_s``), and
the (deployment, tenant) pairs already recorded. Shared by the ingest threads behind one lock.

A batch's additions are remembered only once its transaction commits (:meth:`committed`): a
rolled-back and retried batch must not find them remembered and skip storing them.

Invariant: facts read before a :meth:`forget` are never remembered after it. A batch that
read a deployment's verifications while a new one was being committed would otherwise put
the old ones back into the cache after the writer's ``forget`` and keep them for ``ttl_s``
(a verified limit judged as unverified for the next prompts). Each ``forget`` moves an
epoch on; a load remembers what it read only if the epoch it started in is still current.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from sqlalchemy import Connection

from collector import deployment_facts as F
from engine_probe import events as ev
from policies import NodeConfig

# How long a deployment's configs and verifications are reused between batches without
# reading them again. A batch carrying an engine.config always reads them fresh (drift is
# judged against what is stored); what another replica stored, or a verification posted
# elsewhere, is seen within this long (and by the timer's pass in any case).
FACTS_TTL_S = 5.0
_KNOWN_TENANTS_MAX = 100_000


class FactsCache:
    def __init__(self, ttl_s: float = FACTS_TTL_S):
        self.ttl_s = ttl_s
        # deployment -> (loaded at, its node configs, its verifications)
        self._facts: dict[str, tuple[float, dict[tuple[str, str], NodeConfig], F.Verdicts]] = {}
        self._known_tenants: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._epoch = 0  # moved on by forget(): loads begun before it are not remembered

    def prior_configs(
        self, conn: Connection, events: Sequence[ev.Event]
    ) -> dict[tuple[str, str], NodeConfig]:
        """Each touched deployment's node configs before the batch (call before storing it):
        read fresh when the batch reports a config, else reused for ``ttl_s``."""
        deps = {e.deployment_id for e in events}
        fresh = any(isinstance(e, ev.EngineConfig) for e in events)
        out: dict[tuple[str, str], NodeConfig] = {}
        stale = set()
        now = time.monotonic()
        with self._lock:
            epoch = self._epoch
            for d in deps:
                hit = self._facts.get(d)
                if fresh or hit is None or now - hit[0] > self.ttl_s:
                    stale.add(d)
                else:
                    out.update(hit[1])
        if stale:
            loaded = F.node_configs(conn, stale)
            verified = F.verdicts(conn, stale)
            with self._lock:
                for d in stale:
                    if self._epoch != epoch:
                        break  # forgotten while reading: the next batch reads again
                    mine = {k: v for k, v in loaded.items() if k[0] == d}
                    self._facts[d] = (now, mine, verified.of(d))
            out.update(loaded)
        return out

    def verifications(self, deps: set[str]) -> F.Verdicts:
        """The cached verifications of these deployments."""
        with self._lock:
            out = F.Verdicts()
            for d in deps:
                hit = self._facts.get(d)
                if hit is not None:
                    out.merge(hit[2])
            return out

    def new_tenants(self, pairs: set[tuple[str, str]]) -> set[tuple[str, str]]:
        """Of these (deployment, tenant) pairs, those not known to be recorded yet."""
        with self._lock:  # committed() adds to it from other ingest threads
            return pairs - self._known_tenants

    def _remember_configs(self, configs: dict[tuple[str, str], NodeConfig]) -> None:
        with self._lock:
            for (d, node), cfg in configs.items():
                hit = self._facts.get(d)
                if hit is not None:
                    hit[1][(d, node)] = cfg

    def committed(
        self,
        new_tenants: set[tuple[str, str]],
        configs: dict[tuple[str, str], NodeConfig],
    ) -> None:
        """A batch has committed: remember the tenants and configs it stored."""
        with self._lock:
            if len(self._known_tenants) > _KNOWN_TENANTS_MAX:
                self._known_tenants.clear()
            self._known_tenants |= new_tenants
        if configs:
            self._remember_configs(configs)

    def forget(self, deployment_id: str | None = None) -> None:
        """Drop cached facts (all, or one deployment's): the next batch reads them again,
        and a read already under way is not remembered. Call it after the change committed
        (a batch reading between a ``forget`` and the commit would see the old facts)."""
        with self._lock:
            self._epoch += 1
            if deployment_id is None:
                self._facts.clear()
            else:
                self._facts.pop(deployment_id, None)
