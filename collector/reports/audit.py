"""The audit log's chain check as a service, for ``GET /v1/audit/verify`` and ``kvwatch audit
verify`` alike, and the bundle that carries the log elsewhere (``kvwatch audit export``).

A bundle is a directory: ``entries.jsonl`` (every entry, in id order, as the chain hashes it)
and ``manifest.json`` (format, entry count, the chain's head hash, the SHA-256 of every file,
when it was exported). :func:`verify_bundle` checks it without the database: the manifest's
file hashes, the chain, and that the head and count are the manifest's.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from collector.audit import ChainCheck, entries, verify, verify_entries
from collector.db import Database
from collector.errors import InvalidInput
from collector.timefmt import iso

BUNDLE_FORMAT = "kvwatch-audit-bundle/1"
ENTRIES = "entries.jsonl"
MANIFEST = "manifest.json"


class AuditLog:
    """The chain check as a service: a read transaction of its own (``GET /v1/audit/verify``)."""

    def __init__(self, db: Database):
        self.db = db

    def verify(self) -> ChainCheck:
        """The chain, then every incident's awareness and deadline against their latest
        logged values (:func:`collector.cases.facts.check`)."""
        from collector.cases import facts

        with self.db.read() as conn:
            check = verify(conn)
            wrong = facts.check(conn) if check.ok else []
        if wrong:
            return ChainCheck(False, check.entries, None, facts.describe(wrong))
        return check

    def export(self, out: Path, now: datetime) -> tuple[dict[str, Any], ChainCheck]:
        """Write the bundle into ``out`` (created; must be empty); returns the manifest and
        the chain's check at export (a broken chain is exported as it is, and says so)."""
        if out.exists() and any(out.iterdir()):
            raise InvalidInput(f"{out}: not empty (a bundle goes into a directory of its own)")
        out.mkdir(parents=True, exist_ok=True)
        with self.db.read() as conn:
            rows = list(entries(conn))
        check = verify_entries(rows)
        path = out / ENTRIES
        with path.open("w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n")
        manifest = {
            "format": BUNDLE_FORMAT,
            "exported_at": iso(now),
            "entries": len(rows),
            "head": check.head,
            "chain_intact_at_export": check.ok,
            "files": {ENTRIES: _sha256(path)},
        }
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        return manifest, check


def verify_bundle(bundle: Path) -> ChainCheck:
    """Check a bundle without the database. Raises :class:`InvalidInput` when it is not a
    bundle at all; a bundle that does not verify is a failed :class:`ChainCheck`."""
    try:
        manifest = json.loads((bundle / MANIFEST).read_text(encoding="utf-8"))
        if manifest.get("format") != BUNDLE_FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}, not {BUNDLE_FORMAT}")
        files = dict(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidInput(f"{bundle}: not an audit bundle ({exc})") from None
    for name, digest in sorted(files.items()):
        path = bundle / name
        if not path.is_file() or _sha256(path) != digest:
            return ChainCheck(False, 0, None, f"{name} is missing or not the file exported")
    with (bundle / ENTRIES).open(encoding="utf-8") as f:
        check = verify_entries(json.loads(line) for line in f if line.strip())
    if not check.ok:
        return check
    if check.entries != manifest.get("entries") or check.head != manifest.get("head"):
        return ChainCheck(
            False,
            check.entries,
            None,
            f"the manifest says {manifest.get('entries')} entries ending at "
            f"{manifest.get('head')}; the bundle holds {check.entries} ending at {check.head}",
        )
    return check


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
