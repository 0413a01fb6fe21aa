"""Where an engine's KV goes past its pool, read off the engine's own configuration: the
``engine.config`` fields ``kv_connector``, ``kv_connector_version`` and ``kv_tiers``.

What each source can say (docs/prefix-cache.md, "Past the pool"):

- vLLM's native offloading (``OffloadingConnector``, ``SimpleCPUOffloadConnector``, or
  ``--kv-offloading-backend native``): one CPU tier of ``cpu_bytes_to_use``; its keys are the
  request's block hashes, which carry ``cache_salt`` (vLLM hashes the salt into the first
  block and every later block through its parent), so the tier is salted.
- LMCache in the engine's process (vLLM's ``LMCacheConnectorV1``, SGLang's
  ``--enable-lmcache`` before 0.5.21): the tiers LMCache's own configuration turns on
  (``LMCACHE_CONFIG_FILE`` or SGLang's ``--lmcache-config-file``, then ``LMCACHE_*``
  variables): ``local_cpu``, ``local_disk``, ``remote_url``, with their sizes. Whether
  LMCache's key carries the salt is its version's business (the advisories), not its
  configuration's: ``salted`` is unknown.
- LMCache's multi-process server (``LMCacheMPConnector``): its tiers are the server's
  configuration, in another process: the connector and version only.
- SGLang's hierarchical cache: a CPU tier (the host pool, part of the radix tree, keyed as
  the tree is, which the SGLang version decides) and, with ``--hicache-storage-backend``, a
  storage tier (``file`` on disk, the others remote) whose key is the backend's: unknown.
- A ``MultiConnector``: the member that keeps KV (offloading or LMCache) is reported; a
  transfer-only member (NIXL, P2P NCCL, Mooncake) is disaggregation, not a tier.

Every reader takes duck-typed config objects and never raises: what it cannot read it
leaves out (a probe never stops an engine).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Mapping
from typing import Any

from engine_probe.events import MAX_KV_TIERS, KvMedium, KvTier

log = logging.getLogger("kvwatch.probe")

_GIB = 1 << 30
#: vLLM connectors that keep KV for later requests (the rest move it between nodes)
_OFFLOADING = ("OffloadingConnector", "SimpleCPUOffloadConnector")
_LMCACHE_IN_PROCESS = ("LMCacheConnectorV1", "LMCacheConnector")
_LMCACHE_MP = ("LMCacheMPConnector",)
#: vLLM connectors whose job is prefill/decode transfer between nodes
_TRANSFER = ("NixlConnector", "NixlPullConnector", "NixlPushConnector", "P2pNcclConnector",
             "MooncakeConnector", "MoRIIOConnector")  # fmt: skip


def lmcache_version() -> str | None:
    try:
        return importlib.metadata.version("lmcache")[:64]
    except importlib.metadata.PackageNotFoundError:
        return None


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


#: the contract's ceiling on a tier's size (``KvTier.capacity_bytes``)
_MAX_BYTES = 2**60


def _bytes(n: Any) -> int | None:
    """A size in bytes as the contract takes it: None for what is not a non-negative finite
    number, clamped to its ceiling (a config's typo must not cost the whole engine.config)."""
    try:
        value = float(n)
    except (TypeError, ValueError):
        return None
    if not 0 <= value < float("inf"):
        return None
    return min(int(value), _MAX_BYTES)


def _gib(value: Any) -> int | None:
    try:
        n = float(value)
    except (TypeError, ValueError):
        return None
    return _bytes(n * _GIB)


def lmcache_settings(config_file: str | None, env: Mapping[str, str]) -> dict[str, Any]:
    """LMCache's tier settings as LMCache reads them: the YAML file, then ``LMCACHE_*``
    variables (``LMCACHE_LOCAL_DISK`` and so on) over it."""
    out: dict[str, Any] = {"local_cpu": True, "max_local_cpu_size": 5.0}  # LMCache's defaults
    path = config_file or env.get("LMCACHE_CONFIG_FILE")
    if path:
        try:
            import yaml

            with open(path, encoding="utf-8") as fh:
                doc = yaml.safe_load(fh)
            if isinstance(doc, dict):
                out.update(doc)
        except Exception as exc:
            log.warning("kvwatch could not read LMCache's configuration %s: %s", path, exc)
    for key in ("local_cpu", "max_local_cpu_size", "local_disk", "max_local_disk_size",
                "remote_url"):  # fmt: skip
        value = env.get(f"LMCACHE_{key.upper()}")
        if value is not None:
            out[key] = value
    return out


def lmcache_tiers(settings: Mapping[str, Any]) -> tuple[KvTier, ...]:
    tiers = []
    if _truthy(settings.get("local_cpu")):
        size = _gib(settings.get("max_local_cpu_size"))
        tiers.append(KvTier(medium="cpu", backend="lmcache", capacity_bytes=size))
    if settings.get("local_disk"):
        size = _gib(settings.get("max_local_disk_size"))
        tiers.append(KvTier(medium="disk", backend="lmcache", capacity_bytes=size))
    if settings.get("remote_url"):
        scheme = str(settings["remote_url"]).split("://", 1)[0][:64] or "lmcache"
        tiers.append(KvTier(medium="remote", backend=scheme))
    return tuple(tiers)


def _extra(ktc: Any) -> Mapping[str, Any]:
    extra = getattr(ktc, "kv_connector_extra_config", None)
    return extra if isinstance(extra, Mapping) else {}


def _vllm_member(ktc: Any) -> tuple[str, Mapping[str, Any]]:
    """The connector that keeps KV, and its extra config: a MultiConnector's first member
    that offloads or is LMCache, else its first member."""
    name = str(getattr(ktc, "kv_connector", "") or "")
    extra = _extra(ktc)
    if name != "MultiConnector":
        return name, extra
    listed = extra.get("connectors")
    members = [m for m in (listed if isinstance(listed, list) else []) if isinstance(m, Mapping)]
    keeping = (*_OFFLOADING, *_LMCACHE_IN_PROCESS, *_LMCACHE_MP)
    keeps = [m for m in members if m.get("kv_connector") in keeping]
    chosen = (keeps or members or [{}])[0]
    inner = chosen.get("kv_connector_extra_config")
    return str(chosen.get("kv_connector") or name), inner if isinstance(inner, Mapping) else {}


def vllm_offloading_flags(size_gib: Any, backend: Any) -> dict[str, Any]:
    """What vLLM's ``--kv-offloading-size`` (GiB) and ``--kv-offloading-backend`` say, where
    only they are seen (``vllm:cache_config_info``'s labels, from outside the engine): vLLM
    turns ``native`` into its OffloadingConnector and ``lmcache`` into LMCacheMPConnector
    (whose tiers are the LMCache server's). Nothing when no size is set."""
    size = _gib(size_gib)
    if not size:
        return {}
    if str(backend) == "lmcache":
        return {"kv_connector": "LMCacheMPConnector"}
    return {
        "kv_connector": "OffloadingConnector",
        "kv_tiers": (KvTier(medium="cpu", backend="native", capacity_bytes=size, salted=True),),
    }


def _transfers(ktc: Any) -> bool:
    """The connector (or a MultiConnector's member) moves KV between nodes."""
    name = str(getattr(ktc, "kv_connector", "") or "")
    if name != "MultiConnector":
        return name in _TRANSFER
    members = _extra(ktc).get("connectors")
    return any(
        isinstance(m, Mapping) and m.get("kv_connector") in _TRANSFER
        for m in (members if isinstance(members, list) else [])
    )


def vllm_destinations(vllm_config: Any, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``kv_connector``, ``kv_connector_version``, ``kv_tiers`` and ``disaggregated`` of a
    vLLM configuration: disaggregated only where a connector moves KV between nodes (a
    producer or consumer role, or a transfer connector), not where it keeps KV for later."""
    env = os.environ if env is None else env
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if ktc is None:
        return {"disaggregated": False}
    role = str(getattr(ktc, "kv_role", "") or "")
    out: dict[str, Any] = {"disaggregated": role in ("kv_producer", "kv_consumer")}
    try:
        name, extra = _vllm_member(ktc)
        out["kv_connector"] = name[:64] or None
        out["disaggregated"] = out["disaggregated"] or _transfers(ktc)
        if name in _OFFLOADING:
            out["kv_tiers"] = (
                KvTier(
                    medium="cpu",
                    backend="native",
                    capacity_bytes=_bytes(extra.get("cpu_bytes_to_use")),
                    salted=True,
                ),
            )
        elif name in _LMCACHE_IN_PROCESS:
            out["kv_connector_version"] = lmcache_version()
            out["kv_tiers"] = lmcache_tiers(lmcache_settings(None, env))[:MAX_KV_TIERS]
        elif name in _LMCACHE_MP:
            out["kv_connector_version"] = lmcache_version()
    except Exception:
        log.exception(
            "kvwatch could not read the KV connector %s", getattr(ktc, "kv_connector", "?")
        )
    return out


def sglang_destinations(server_args: Any, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``kv_connector``, ``kv_connector_version`` and ``kv_tiers`` of SGLang's server
    arguments (hierarchical cache, or LMCache)."""
    env = os.environ if env is None else env
    if server_args is None:
        return {}
    try:
        if getattr(server_args, "enable_lmcache", False):
            cfg = getattr(server_args, "lmcache_config_file", None)
            return {
                "kv_connector": "LMCache",
                "kv_connector_version": lmcache_version(),
                "kv_tiers": lmcache_tiers(lmcache_settings(cfg, env))[:MAX_KV_TIERS],
            }
        if not getattr(server_args, "enable_hierarchical_cache", False):
            return {}
        size = getattr(server_args, "hicache_size", 0) or 0
        tiers = [
            KvTier(
                medium="cpu",
                backend="hicache",
                capacity_bytes=_gib(size) if isinstance(size, int) and size > 0 else None,
                # a level of the radix tree, under the tree's key: salted exactly where
                # the tree is (SGLang's versions decide that: the advisories)
                salted=None,
            )
        ]
        storage = getattr(server_args, "hicache_storage_backend", None)
        if storage:
            medium: KvMedium = "disk" if storage == "file" else "remote"
            tiers.append(KvTier(medium=medium, backend=str(storage)[:64]))
        return {"kv_connector": "hicache", "kv_tiers": tuple(tiers)}
    except Exception:
        log.exception("kvwatch could not read SGLang's KV offload settings")
        return {}
