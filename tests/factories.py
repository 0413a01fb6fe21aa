"""Event builders for tests: valid by default, overridable field by field."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from engine_probe import events as ev

T0 = datetime(2026, 8, 27, 12, 0, tzinfo=UTC)


def base(seq: int, probe: str = "probe-a", dep: str = "glm-prod", **kw: Any) -> dict[str, Any]:
    return {
        "schema_version": 1,
        "probe_id": probe,
        "seq": seq,
        "ts": kw.pop("ts", T0 + timedelta(seconds=seq)),
        "deployment_id": dep,
        **kw,
    }


def admitted(seq: int, rid: str, tenant: str = "acme", prompt: int = 1000, **kw: Any) -> ev.Event:
    fields = {"model_id": "glm-5.3", "route": "/v1/chat/completions"} | kw
    return ev.RequestAdmitted(
        **base(seq, **_pop_base(fields)),
        request_id=rid,
        tenant=tenant,
        prompt_tokens=prompt,
        **fields,
    )


def parallel_sampling(
    seq: int, parent: str, n: int, tenant: str = "acme", prompt: int = 1000, **kw: Any
) -> list[ev.Event]:
    """A request with ``n > 1`` as vLLM's engine core sees it: n admissions (seqs from
    ``seq``) of children ``f"{i}_{parent}"`` with the whole prompt each; children 1..n-1 name
    child 0 in ``prompt_shared_with``. The parent itself is never a request."""
    first = f"0_{parent}"
    return [
        admitted(
            seq + i,
            f"{i}_{parent}",
            tenant,
            prompt,
            prompt_shared_with=first if i else None,
            **kw,
        )
        for i in range(n)
    ]


def finished(seq: int, rid: str, tenant: str = "acme", completion: int = 50, **kw: Any) -> ev.Event:
    fields = {"status": "completed"} | kw
    return ev.RequestFinished(
        **base(seq, **_pop_base(fields)),
        request_id=rid,
        tenant=tenant,
        completion_tokens=completion,
        **fields,
    )


def rejected(
    seq: int, rid: str, tenant: str = "acme", prompt: int = 700_000, **kw: Any
) -> ev.Event:
    fields = {"model_id": "glm-5.3", "reason": "pool_exhausted", "limit_tokens": 681_280} | kw
    return ev.RequestRejected(
        **base(seq, **_pop_base(fields)),
        request_id=rid,
        tenant=tenant,
        prompt_tokens=prompt,
        **fields,
    )


def pool(seq: int, used: int = 100, cap: int = 681_280, **kw: Any) -> ev.Event:
    fields = dict(kw)
    return ev.PoolSample(
        **base(seq, **_pop_base(fields)),
        capacity_tokens=cap,
        used_tokens=used,
        free_tokens=cap - used,
        **fields,
    )


def config(seq: int, pool_tokens: int = 681_280, **kw: Any) -> ev.Event:
    fields = {
        "engine": "sglang",
        "engine_version": "0.5.21",
        "model_id": "glm-5.3",
        "advertised_context": 1_048_576,
        "pool_capacity_tokens": pool_tokens,
        "page_size": 64,
        "dtype": "fp8",
        "role": "prefill",
        "node": "prefill-0",
        "disaggregated": True,
    } | kw
    return ev.EngineConfig(**base(seq, **_pop_base(fields)), **fields)


def stale_read(seq: int, **kw: Any) -> ev.Event:
    fields = {
        "reader_request_id": "r-victim",
        "reader_tenant": "globex",
        "page_ids": [3, 4, 5],
        "previous_request_id": "r-exposed",
        "previous_tenant": "acme",
        "node": "decode-0",
        "role": "decode",
    } | kw
    return ev.PageStaleRead(**base(seq, **_pop_base(fields)), **fields)


def prefix_hit(seq: int, **kw: Any) -> ev.Event:
    fields: dict[str, Any] = {
        "reader_request_id": "r-b",
        "reader_tenant": "globex",
        "owner_request_id": "r-a",
        "owner_tenant": "acme",
        "pages": 3,
        "tokens": 96,
        "salted": False,
    }
    fields.update(kw)
    return ev.PrefixCacheHit(**base(seq, **_pop_base(fields)), **fields)


def canary_hit(seq: int, **kw: Any) -> ev.Event:
    fields: dict[str, Any] = {
        "detector": "paint",
        "reader_request_id": "r-victim",
        "reader_tenant": "globex",
        "canary_tenant": "acme",
        "page_ids": [7],
    } | kw
    return ev.CanaryHit(**base(seq, **_pop_base(fields)), **fields)


def _pop_base(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: fields.pop(k) for k in ("probe", "dep", "ts") if k in fields}


def as_json(event: ev.Event) -> dict[str, Any]:
    return ev.to_builtins(event)
