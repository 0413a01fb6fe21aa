"""Prometheus metrics of refengine's server, in vLLM's names, so that dashboards, alert rules
and kvwatch's own scraper (``kvwatch scrape --engine vllm``) read it as they read vLLM.

Every series carries ``model_name`` (the served id) and ``engine`` (``"0"``: vLLM's
data-parallel engine index; refengine has one engine), as vLLM's do:

* ``vllm:num_requests_running`` (decoding), ``vllm:num_requests_waiting`` (waiting for
  prefill, or, disaggregated, for the transfer to decode: vLLM's decode instance counts a
  request waiting for remote KV as waiting too);
* ``vllm:kv_cache_usage_perc`` (0..1: pages held by requests; idle prefix-cache pages count
  as free, as vLLM's evictable cached blocks do) and ``vllm:cache_config_info`` (1, its labels the
  pool's ``block_size``, ``num_gpu_blocks``, ``kv_cache_size_tokens``, ``cache_dtype`` and
  ``enable_prefix_caching``), one series per KV pool, told apart by ``node`` and ``role``
  (``kv``/``both`` monolithic, ``prefill``/``decode`` disaggregated): refengine serves both
  sides of a disaggregated pair behind one endpoint, where vLLM runs two servers;
* ``vllm:prompt_tokens_total`` (at prefill), ``vllm:generation_tokens_total`` (per token),
  ``vllm:request_success_total{finished_reason}`` (``stop``, ``length``, ``abort``);
* histograms ``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens`` (vLLM's 1-2-5
  buckets up to the advertised context), ``vllm:e2e_request_latency_seconds`` and
  ``vllm:time_to_first_token_seconds`` (vLLM's default buckets);
* ``kvwatch_refengine_pool_capacity_tokens{model_name,node,role}``: each pool's size, the
  figure vLLM only gives as labels;
* with the prefix cache on, ``vllm:prefix_cache_queries_total`` (prompt tokens of the
  requests that looked their prefix up) and ``vllm:prefix_cache_hits_total`` (the tokens
  found cached), as vLLM counts them; ``enable_prefix_caching`` says so on
  ``vllm:cache_config_info``.

vLLM series refengine has no equivalent for (swapping, preemption, LoRA,
speculative decoding) are left out rather than faked. Nothing describes one request:
counters and histograms only, and gauges of the whole engine. The gauges are read from the
engine at scrape time; the hot path only increments precomputed label children.

``promtool check metrics`` accepts everything here except the colon in vLLM's names (it
reserves colons for recording rules): the names are vLLM's, so that complaint is kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from refengine.engine import Engine
from refengine.request import FinishReason

# vLLM's default buckets (vllm/v1/metrics/buckets.py): the same boundaries make the same
# dashboards' quantiles mean the same thing.
REQUEST_LATENCY_BUCKETS: Final = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
FINISH_REASONS: Final[tuple[FinishReason, ...]] = ("stop", "length", "abort")
ENGINE_INDEX: Final = "0"
# vLLM's CacheConfig fields that refengine has (vLLM writes every field as a label).
CACHE_INFO_LABELS: Final = (
    "block_size",
    "num_gpu_blocks",
    "kv_cache_size_tokens",
    "cache_dtype",
    "enable_prefix_caching",
)


def one_two_five(upto: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... while <= ``upto`` (vLLM's token-count buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > upto:
                return out
            out.append(float(m * scale))
        scale *= 10


class ServerMetrics:
    """The metrics of one server app: its own registry, built with the app."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        names = ["model_name", "engine"]
        values = (model_name, ENGINE_INDEX)
        tokens = one_two_five(engine.config.advertised_context)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=self.registry)

        def histogram(name: str, doc: str, buckets: object) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry)  # type: ignore[arg-type]

        prompt = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self._prompt_tokens = prompt.labels(*values)
        gen = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._generation_tokens = gen.labels(*values)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=self.registry,
        )
        self._success = {r: success.labels(*values, r) for r in FINISH_REASONS}
        self._request_prompt = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens
        ).labels(*values)
        self._request_generation = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        ).labels(*values)
        self._e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(*values)
        self._ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        ).labels(*values)
        self.registry.register(_EngineGauges(engine, model_name))

    # -- the hot path: called in the engine thread, with its lock held -----------------------

    def first_token(self, prompt_tokens: int, seconds: float) -> None:
        """Prefill produced the request's first token ``seconds`` after it arrived."""
        self._prompt_tokens.inc(prompt_tokens)
        self._ttft.observe(seconds)

    def generated(self, tokens: int) -> None:
        self._generation_tokens.inc(tokens)

    def finished(
        self, reason: FinishReason, prompt_tokens: int, generated: int, seconds: float
    ) -> None:
        """The request ended (``abort`` included, as vLLM counts it) ``seconds`` after it
        arrived."""
        self._success[reason].inc()
        self._request_prompt.observe(prompt_tokens)
        self._request_generation.observe(generated)
        self._e2e.observe(seconds)


class _EngineGauges(Collector):
    """Queue depths and pool usage, read from the engine at scrape time."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.values = [model_name, ENGINE_INDEX]
        # The pools never change after construction: their label sets are fixed here.
        cfg = engine.config
        self.pools = [
            (
                pool,
                [pool.name, pool.role],
                # CACHE_INFO_LABELS, in order
                [
                    str(pool.page_size),
                    str(pool.num_pages),
                    str(pool.capacity_tokens),
                    cfg.kv_dtype,
                    str(cfg.prefix_caching),
                ],
            )
            for pool in engine.pools.values()
        ]

    def describe(self) -> list[Metric]:
        return []  # read at scrape time

    def collect(self) -> Iterator[Metric]:
        names = ["model_name", "engine"]
        depths = self.engine.queue_depths()
        running = GaugeMetricFamily(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labels=names,
        )
        running.add_metric(self.values, depths.running)
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            labels=names,
        )
        waiting.add_metric(self.values, depths.waiting + depths.transferring)
        pooled = [*names, "node", "role"]
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=pooled
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[*pooled, *CACHE_INFO_LABELS],
        )
        capacity = GaugeMetricFamily(
            "kvwatch_refengine_pool_capacity_tokens",
            "Tokens each KV pool holds (node: the pool; role: prefill, decode or both).",
            labels=["model_name", "node", "role"],
        )
        for pool, where, fields in self.pools:
            # vLLM counts evictable cached blocks as free: so do we (held_tokens)
            usage.add_metric([*self.values, *where], pool.held_tokens / pool.capacity_tokens)
            info.add_metric([*self.values, *where, *fields], 1)
            capacity.add_metric([self.values[0], *where], pool.capacity_tokens)
        yield from (running, waiting, usage, info, capacity)
        cache = self.engine.prefix_cache
        if cache is not None:  # plain ints, read without the engine's lock
            queries = CounterMetricFamily(
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                labels=names,
            )
            queries.add_metric(self.values, cache.queries)
            hits = CounterMetricFamily(
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                labels=names,
            )
            hits.add_metric(self.values, cache.hits)
            yield from (queries, hits)
