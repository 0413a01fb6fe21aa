"""Node identity: the one rule for the id an engine node is reported under.

A node is one KV pool: one engine core (one data-parallel rank) of one engine server. Every
producer that watches a node (the in-engine probe, ``kvwatch scrape``, ``kvwatch kv-events``)
names it with :func:`node_id`, so that what they report about one engine lands on one node
and two replicas of a deployment never share one::

    node id = BASE [ "/dp" RANK ] [ "/tp" RANK ]
    BASE    = KVWATCH_NODE_ID (or a producer's --node), if set
            | HOST ":" PORT [ "/" ROLE ]

* ``HOST:PORT``: the engine's HTTP server (vLLM's ``--host``/``--port``). A wildcard or
  loopback host (unset, ``0.0.0.0``, ``::``, ``localhost``, ``127.x``, ``::1``) is the
  machine's name (``socket.gethostname()``): replicas on several machines all listening on
  ``0.0.0.0:8000`` stay apart, and a scraper pointed at ``http://127.0.0.1:8000`` names the
  engine of its own machine as the engine names itself. Without a port (an engine with no
  HTTP server: vLLM's ``LLM`` in a script) BASE is the host alone.
* ``ROLE``: ``prefill`` or ``decode`` for one side of a disaggregated pair; nothing for a
  node that does both.
* ``/dpN``: the data-parallel rank N, for ranks 1 and up (each rank has its own pool); rank 0
  is BASE itself, so a server that grows a second rank keeps its first node's id, and no
  producer needs to know how many ranks there are (vLLM's engine core of a dense model does
  not: it runs each rank as an engine of its own). ``/tpN``: likewise the tensor-parallel
  rank, for an engine whose ranks each watch their own share of the pool (SGLang).

Ids follow the wire contract's id rule (``events.is_valid_id``): characters outside it become
``-`` and BASE is cut so that the whole id fits ``events.ID_MAX``.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import Final

from engine_probe.events import ID_MAX

__all__ = ["INFO_LABELS", "NODE_INFO", "machine_host", "node_id", "sanitize_id", "server_base"]

#: The info series an engine's plugin publishes beside the engine's own metrics, one per
#: engine core: its node id, role and the settings the engine's metrics do not say (or say
#: unresolved). Scrapers read it, so that they name a node, and report its config, as the
#: probe inside does (``engine_probe.adapters.vllm.node`` publishes it).
NODE_INFO: Final = "kvwatch:node_info"
INFO_LABELS: Final = (
    "engine",
    "node",
    "role",
    "kv_dtype",
    "quantization",
    "tp_size",
    "cuda_graphs",
)
# What ``sanitize_id`` replaces; validation itself is ``events.is_valid_id`` (one rule).
_ID_BAD_CHARS: Final = re.compile(r"[^A-Za-z0-9._:/@+=-]")

_WILDCARD: Final = frozenset({"", "0.0.0.0", "::", "*", "localhost"})
_ROLES_NAMED: Final = frozenset({"prefill", "decode"})


def sanitize_id(raw: str, *, fallback: str = "probe") -> str:
    """Map any string onto the wire contract's Id pattern (host names, node ids)."""
    cleaned = _ID_BAD_CHARS.sub("-", raw)
    if not cleaned or not cleaned[0].isalnum() or not cleaned[0].isascii():
        cleaned = f"{fallback}-{cleaned}" if cleaned else fallback
    return cleaned[:ID_MAX]


def _is_local(host: str) -> bool:
    if host.lower() in _WILDCARD:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def machine_host(host: str | None) -> str:
    """``host`` as node ids name it: a wildcard or loopback address is this machine's name."""
    raw = (host or "").strip()
    return socket.gethostname() if _is_local(raw) else raw


def server_base(host: str | None, port: int | None, role: str | None = None) -> str:
    """The derived BASE of a node id: ``HOST:PORT`` (``HOST`` when no port) and, for one side
    of a disaggregated pair, ``/ROLE``."""
    name = machine_host(host)
    base = f"{name}:{port}" if port is not None else name
    return f"{base}/{role}" if role in _ROLES_NAMED else base


def node_id(
    base: str,
    *,
    dp_rank: int | None = None,
    tp_rank: int | None = None,
) -> str:
    """The node id of one KV pool: ``base`` (KVWATCH_NODE_ID, a --node, or
    :func:`server_base`) with the rank suffixes the module docstring describes."""
    suffix = ""
    if dp_rank:
        suffix += f"/dp{int(dp_rank)}"
    if tp_rank:
        suffix += f"/tp{int(tp_rank)}"
    cleaned = sanitize_id(base, fallback="node")[: ID_MAX - len(suffix)]
    return cleaned + suffix
