"""The settings an engine plugin (vLLM, SGLang) configures its probe with: the ``KVWATCH_*``
environment, plus a default spool directory, so that the write-ahead journal
(``engine_probe.journal``) is on by default in an engine.

Why only the plugins: an engine process is the one that gets killed (OOM killer, a
supervisor's SIGKILL, a crash in native code) with events not yet sent, and a plugin's
process is one per engine on a node; the library's own default stays explicit (no spool,
no journal unless ``KVWATCH_PROBE_SPOOL_DIR`` is set), because tests and tools build many
probes, which must not adopt each other's files from a shared directory.

The default: ``$XDG_STATE_HOME/kvwatch/probe-spool`` (``~/.local/state/kvwatch/probe-spool``
without it), per user, so that the next engine process of the same user on the node adopts
what a killed one left. Off: ``KVWATCH_PROBE_JOURNAL_BYTES=0`` (memory only, as without a
spool dir), or set ``KVWATCH_PROBE_SPOOL_DIR`` to choose the directory.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from engine_probe.settings import ProbeSettings

log = logging.getLogger("engine_probe")


def default_spool_dir() -> Path:
    """The per-user state directory the plugins spool and journal in by default."""
    state = os.environ.get("XDG_STATE_HOME", "").strip()
    base = Path(state) if state else Path.home() / ".local" / "state"
    return base / "kvwatch" / "probe-spool"


def plugin_settings() -> ProbeSettings:
    """``ProbeSettings()`` from the environment, with ``default_spool_dir()`` as the spool
    directory when none is set and the journal is on. A default directory that cannot be
    created or written is logged and left out (the probe then runs memory-only, as it did
    before: an engine must not lose its probe to a read-only home directory). Raises what
    ``ProbeSettings()`` raises for bad settings."""
    settings = ProbeSettings()
    if (
        settings.collector_url is None
        or settings.probe_spool_dir is not None
        or settings.probe_journal_bytes == 0
    ):
        return settings
    directory = default_spool_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(f"{directory} is not writable")
    except OSError as exc:
        log.warning(
            "kvwatch: no spool/journal directory (default %s: %s); set KVWATCH_PROBE_SPOOL_DIR "
            "to keep events across a crash, or KVWATCH_PROBE_JOURNAL_BYTES=0 to silence this",
            directory,
            exc,
        )
        return settings
    return settings.model_copy(update={"probe_spool_dir": directory})


def describe_journal(probe: object) -> str:
    """The attach line's words for where (and whether) the probe journals its events."""
    settings = getattr(probe, "settings", None)
    stats = probe.stats() if hasattr(probe, "stats") else {}
    journal = stats.get("journal") if isinstance(stats, dict) else None
    spool = getattr(settings, "probe_spool_dir", None)
    if isinstance(journal, dict) and journal.get("enabled"):
        cap = getattr(settings, "probe_journal_bytes", 0) >> 20
        return f"journal on in {spool} ({cap} MiB; KVWATCH_PROBE_JOURNAL_BYTES=0: off)"
    if spool is None:
        return "journal off (no spool directory: events are lost if the engine is killed)"
    why = journal.get("last_error") if isinstance(journal, dict) else None
    return f"journal off in {spool}" + (f" ({why})" if why else "")
