"""Engine ``/metrics`` → kvwatch's ``engine.config`` and ``pool.sample`` figures.

For deployments without the in-engine probe: vLLM's and SGLang's Prometheus metrics (read
with prometheus-client's parser) give pool capacity, page size, the advertised context and
occupancy per node, enough for the pool-versus-advertised checks and the occupancy charts.
Prompt-token counters and histograms carry no request ids, so they become no request events;
they are in :meth:`Scrape.summary`.

Used by ``kvwatch scrape``, by ``kvwatch kv-events`` (the engine's figures beside its
events) and by the collector's scheduled scraper, which ``kvwatch serve`` hands it
(:mod:`kvwatch.scheduled_scrape`). It observes an engine from outside, so it lives in
kvwatch/, and stands alone there: of ours it imports only the contract and
:mod:`engine_probe.errors` (never torch, the probe's machinery or the collector), beside the
standard library and prometheus-client.
"""

from kvwatch.scrape.errors import (
    BadTarget,
    MalformedMetrics,
    NotThatEngine,
    ScrapeError,
    TargetUnreachable,
)
from kvwatch.scrape.exposition import parse
from kvwatch.scrape.fetch import Target, TargetScraper, make_target, redact, translate
from kvwatch.scrape.figures import ENGINES, ROLES, NodeFigures, PromptFigures, Scrape

__all__ = [
    "ENGINES",
    "ROLES",
    "BadTarget",
    "MalformedMetrics",
    "NodeFigures",
    "NotThatEngine",
    "PromptFigures",
    "Scrape",
    "ScrapeError",
    "Target",
    "TargetScraper",
    "TargetUnreachable",
    "make_target",
    "parse",
    "redact",
    "translate",
]
