"""The audit log's chain check as a service, for ``GET /v1/audit/verify`` and ``kvwatch audit
verify`` alike, and the bundle that carries the log elsewhere (``kvwatch audit export``).

A bundle is a directory: ``entries.jsonl`` (every entry, in id order, as the chain hashes it)
and ``manifest.json`` (format, entry count, the chain's head hash, the SHA-256 of every file,
when it was exported), and ``manifest.sig``: the collector's signature over both files' hashes
(:mod:`collector.signing`). The export first appends a signed checkpoint of the head
(:mod:`collector.audit_checkpoints`). :func:`verify_bundle` checks it without the database:
the manifest's file hashes, the chain, and that the head and count are the manifest's;
:func:`verify_bundle_keyed` also the manifest's signature and every checkpoint's, against the
published keys (a bundle rewritten without the key fails).
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from collector.audit import ChainCheck, entries, verify, verify_entries
from collector.audit_checkpoints import KeyedCheck, checkpoint, verify_keyed
from collector.db import Database
from collector.errors import InvalidInput
from collector.signing import KeyRing, SignatureInvalid, sha256_file, statement
from collector.signing import verify as verify_signature
from collector.timefmt import iso, parse_iso

BUNDLE_FORMAT = "kvwatch-audit-bundle/1"
ENTRIES = "entries.jsonl"
MANIFEST = "manifest.json"
MANIFEST_SIG = "manifest.sig"
KEYS = "keys.jwks"  # the public key set at export, for a verifier without the published one


class AuditLog:
    """The chain check as a service: a read transaction of its own (``GET /v1/audit/verify``)."""

    def __init__(self, db: Database, ring: KeyRing | None = None, period_s: float = 3600.0):
        self.db = db
        self.ring = ring  # signs checkpoints and bundles (None: unsigned, as before)
        self.period_s = period_s  # KVWATCH_AUDIT_CHECKPOINT_S

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

    def verify_keyed(self, key_set: dict[str, Any], now: datetime) -> KeyedCheck:
        """The chain and its signed checkpoints against ``key_set`` (the published keys)."""
        plain = self.verify()  # the chain, and whatever else verify() checks
        if not plain.ok:
            return KeyedCheck(plain, False, plain.problem, plain.first_bad_id)
        with self.db.read() as conn:
            return verify_keyed(entries(conn), key_set, period_s=self.period_s, now=now)

    def checkpoint(self, *, actor: str, now: datetime) -> int | None:
        """Append a signed checkpoint of the head (the collector's periodic pass); returns
        the entry signed, None when nothing new was appended since the last one."""
        if self.ring is None:
            return None
        with self.db.write() as conn:
            return checkpoint(conn, self.ring, actor=actor, now=now)

    def export(
        self, out: Path, now: datetime, *, actor: str = "cli"
    ) -> tuple[dict[str, Any], ChainCheck]:
        """Write the bundle into ``out`` (created; must be empty); returns the manifest and
        the chain's check at export (a broken chain is exported as it is, and says so).
        With a key ring, the head is checkpointed first and the manifest signed."""
        if out.exists() and any(out.iterdir()):
            raise InvalidInput(f"{out}: not empty (a bundle goes into a directory of its own)")
        out.mkdir(parents=True, exist_ok=True)
        self.checkpoint(actor=actor, now=now)
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
        if self.ring is not None:
            (out / KEYS).write_text(json.dumps(self.ring.public_set(), indent=2) + "\n")
            claims = statement(
                sub="audit:bundle",
                iat=now,
                files={
                    ENTRIES: _sha256(path),
                    MANIFEST: sha256_file(out / MANIFEST),
                    KEYS: sha256_file(out / KEYS),
                },
                conclusions={"entries": len(rows), "head": check.head},
            )
            (out / MANIFEST_SIG).write_text(self.ring.sign(claims, now=now), encoding="ascii")
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


def verify_bundle_keyed(bundle: Path, key_set: dict[str, Any], period_s: float) -> KeyedCheck:
    """:func:`verify_bundle`, then the manifest's signature (missing or invalid: a failed
    check) and every checkpoint's, against the published ``key_set``; the checkpoint period is
    counted to the bundle's export time."""
    plain = verify_bundle(bundle)
    if not plain.ok:
        return KeyedCheck(plain, False, plain.problem, plain.first_bad_id)
    manifest = json.loads((bundle / MANIFEST).read_text(encoding="utf-8"))
    try:
        token = (bundle / MANIFEST_SIG).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return KeyedCheck(plain, False, f"{MANIFEST_SIG} is missing: the bundle is not signed")
    try:
        v = verify_signature(token, key_set)
    except SignatureInvalid as exc:
        return KeyedCheck(plain, False, f"{MANIFEST_SIG} does not verify: {exc}")
    for name in (ENTRIES, MANIFEST):
        want = v.claims.get("files", {}).get(name)
        if want != _sha256(bundle / name):
            return KeyedCheck(plain, False, f"{name} is not the file {MANIFEST_SIG} signs")
    with (bundle / ENTRIES).open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    out = verify_keyed(rows, key_set, period_s=period_s, now=parse_iso(manifest["exported_at"]))
    out.keys.setdefault(v.kid, v.retired_at)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
