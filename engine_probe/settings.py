"""Probe settings, read from ``KVWATCH_*`` environment variables.

``KVWATCH_COLLECTOR_URL`` and ``KVWATCH_INGEST_TOKEN`` are public names shared by every
producer (probes, gateway, scraper, verifier): the field names here must never change.
Everything is validated when the settings object is built, so the hot path never checks.
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path
from typing import Final, Self

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine_probe.events import ID_MAX, is_valid_id
from engine_probe.journal import JOURNAL_MIN_BYTES
from engine_probe.node import sanitize_id

__all__ = ["GIB", "ProbeSettings", "ProducerSettings", "derive_probe_id", "sanitize_id"]

# Room kept after a probe id's root for "-{pid}-{hex}" (see ``derive_probe_id``).
_SUFFIX_ROOM: Final = 1 + 10 + 1 + 6

GIB: Final = 1 << 30
JOURNAL_DEFAULT_BYTES: Final = 64 << 20


def derive_probe_id(root: str | None = None) -> str:
    """A new probe id ``{root}-{pid}-{6 random hex}``; ``root`` defaults to the host name.

    The random part makes ids unique across pid reuse, restarts and forks: the collector
    deduplicates on (probe_id, seq), so a seq space must never be reused under one id. The
    root is cut so that the whole id stays within ``ID_MAX`` characters.
    """
    base = sanitize_id(root if root is not None else socket.gethostname(), fallback="host")
    base = base[: ID_MAX - _SUFFIX_ROOM]
    return f"{base}-{os.getpid()}-{secrets.token_hex(3)}"


def _check_id(value: str, env_var: str) -> str:
    if not is_valid_id(value):
        raise ValueError(
            f"{env_var}={value!r} is not a valid id: 1 to {ID_MAX} characters, starting with "
            "a letter or digit, then only letters, digits and ._:/@+=- "
            "(no spaces, no trailing newline)"
        )
    return value


class ProducerSettings(BaseSettings):
    """What every producer reads: where the collector is, the ingest token, and the
    deployment its events belong to (``KVWATCH_COLLECTOR_URL``, ``KVWATCH_INGEST_TOKEN``,
    ``KVWATCH_DEPLOYMENT_ID``), and the node id an engine's producers report it under
    (``KVWATCH_NODE_ID``, unset: derived, see :mod:`engine_probe.node`). The probe's
    settings extend it; ``kvwatch verify`` uses it as is."""

    model_config = SettingsConfigDict(env_prefix="KVWATCH_", extra="ignore", frozen=True)

    collector_url: str | None = Field(
        default=None,
        description="The collector's root URL, where events go; unset: the probe is a no-op "
        "(nothing is recorded, nothing sent).",
    )
    ingest_token: str | None = Field(
        default=None,
        repr=False,
        description="The ingest bearer token (kvwatch tokens create --kind ingest).",
    )
    deployment_id: str = Field(
        default="default", description="The deployment the events belong to."
    )
    node_id: str | None = Field(
        default=None,
        description="The node id this engine reports (default: derived, the engine server's "
        "HOST:PORT, HOST being the machine's name for a wildcard or loopback address, plus "
        "/prefill or /decode for one side of a disaggregated pair). Data-parallel ranks 1 "
        "and up still add /dpN to it. See engine_probe/node.py and docs/vllm.md.",
    )

    @field_validator("collector_url", "ingest_token", "node_id", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        # An exported-but-empty environment variable means "not set", not "the empty string".
        if isinstance(value, str) and not value.strip():
            return None
        return value

    @field_validator("collector_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip().rstrip("/")
        scheme, sep, rest = value.partition("://")
        if not sep or scheme.lower() not in ("http", "https") or not rest or rest[0] == "/":
            raise ValueError(f"collector_url {value!r} must be an http:// or https:// URL")
        return value

    @field_validator("deployment_id")
    @classmethod
    def _check_deployment_id(cls, value: str) -> str:
        return _check_id(value, "KVWATCH_DEPLOYMENT_ID")

    @field_validator("node_id")
    @classmethod
    def _check_node_id(cls, value: str | None) -> str | None:
        return None if value is None else _check_id(value, "KVWATCH_NODE_ID")


class ProbeSettings(ProducerSettings):
    """Settings of one in-engine probe. Immutable once built.

    ``collector_url`` None means "do not export": :func:`engine_probe.configure_probe` then
    keeps the no-op probe (nothing is recorded, so nothing can pile up unsent).
    ``probe_id`` is the ROOT of the probe ids, not an id: every process (and every forked
    child, and every ``Probe`` built) uses ``{root}-{pid}-{6 random hex}`` (root cut to fit
    ``events.ID_MAX``), because the seq counter restarts at 1 with every process and the
    collector deduplicates on (probe_id, seq). The root defaults to the host name; the same
    root may be configured for any number of processes and restarts. ``Probe.probe_id`` is
    the id actually sent.

    ``probe_max_attempts``: how many times one batch may be refused with an HTTP answer
    that says nothing about the collector being unavailable (a 500 on bad input, a 404, a
    403 for an adopted batch of another probe's id, ...) before it goes to the dead-letter
    directory and the next batch gets its turn. Connection errors, timeouts, 401, a 403 for
    the probe's own batch (its token's scope: fixed by a person), 429, 502, 503 and 504 are
    retried forever.
    """

    probe_id: str | None = Field(
        default=None,
        description="Root of this probe's ids (default: the host name). Each process appends "
        "'-{pid}-{6 random hex}', so one root may serve any number of processes and restarts.",
    )
    probe_spool_dir: Path | None = Field(
        default=None,
        description="Where batches wait while the collector is down, replayed in order, and "
        "where the write-ahead journal lives (unset: memory only; the vLLM and SGLang plugins "
        "then use $XDG_STATE_HOME/kvwatch/probe-spool).",
    )
    probe_buffer_size: int = Field(
        default=65536,
        ge=1,
        le=1 << 26,
        description="Events held in memory; beyond it new events are dropped and counted.",
    )
    probe_batch_size: int = Field(default=2000, ge=1, description="Events per POST.")
    probe_flush_interval_s: float = Field(
        default=0.5, gt=0, le=3600, description="Longest wait before a partial batch is sent."
    )
    probe_max_spool_bytes: int = Field(
        default=GIB, ge=1, description="Spool cap; beyond it batches are dropped and counted."
    )
    probe_journal_bytes: int = Field(
        default=JOURNAL_DEFAULT_BYTES,
        ge=0,
        description="Cap of the write-ahead journal in the spool directory, where every event "
        "is also written (file-mapped, no syscall per event) until it is delivered or spooled, "
        "so that a process killed by a signal loses nothing: the next probe on the node "
        "replays it. 0: off. Needs probe_spool_dir; when full, events are still sent but not "
        "crash-safe (counted in stats()).",
    )
    probe_request_timeout_s: float = Field(
        default=10.0, gt=0, le=3600, description="HTTP timeout of one POST."
    )
    probe_backoff_base_s: float = Field(
        default=0.2, gt=0, description="First retry delay (exponential backoff, full jitter)."
    )
    probe_backoff_max_s: float = Field(default=30.0, gt=0, description="Longest retry delay.")
    probe_max_attempts: int = Field(
        default=8,
        ge=1,
        le=1_000_000,
        description="How often the collector may refuse one batch (404, 500, a 403 for an "
        "adopted spool's other probe id, ...) before it goes to <spool>/rejected/ and counts "
        "as dropped; connection errors, timeouts, 401, 403 for the probe's own events (a "
        "token to fix), 429, 502, 503 and 504 are retried forever.",
    )
    probe_atexit_timeout_s: float = Field(
        default=2.0, ge=0, le=600, description="How long interpreter exit waits to flush."
    )

    @field_validator("probe_id", "probe_spool_dir", mode="before")
    @classmethod
    def _empty_probe_field_is_unset(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip():
            return None
        return value

    @field_validator("probe_id")
    @classmethod
    def _check_probe_id(cls, value: str | None) -> str | None:
        return None if value is None else _check_id(value, "KVWATCH_PROBE_ID")

    @model_validator(mode="after")
    def _check_relations(self) -> Self:
        if self.probe_batch_size > self.probe_buffer_size:
            raise ValueError(
                f"probe_batch_size ({self.probe_batch_size}) must not exceed "
                f"probe_buffer_size ({self.probe_buffer_size})"
            )
        if 0 < self.probe_journal_bytes < JOURNAL_MIN_BYTES:
            raise ValueError(
                f"probe_journal_bytes ({self.probe_journal_bytes}) must be 0 (off) or at "
                f"least {JOURNAL_MIN_BYTES}"
            )
        if self.probe_backoff_base_s > self.probe_backoff_max_s:
            raise ValueError(
                f"probe_backoff_base_s ({self.probe_backoff_base_s}) must not exceed "
                f"probe_backoff_max_s ({self.probe_backoff_max_s})"
            )
        return self

    @property
    def events_url(self) -> str | None:
        return None if self.collector_url is None else f"{self.collector_url}/v1/events"
