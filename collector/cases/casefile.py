"""The case file: one signed bundle of everything about an incident that a regulator asks
for, checked offline (``kvwatch incidents export ID --out DIR``, ``kvwatch report verify
--bundle DIR``).

One flat directory (every name is unique: report and notice ids are):

- ``breach-<rpt>.json/.csv/.pdf`` and ``breach-<rpt>.sig``: the incident's breach assessment
  (the newest stored, signed one; one is made when there is none), signed as every report is
  (:mod:`collector.reports.signed`); the CSV is the evidence rows (every affected request);
- ``stale-reads.json``: the stale reads the assessment rests on (evidence rows);
- ``<ntc>.json`` and ``<ntc>.sig``: each notice sent (or acknowledged), as stored in the
  case register and signed when it was prepared;
- ``notifications.json``, ``decisions.json``: the case register (per party: prepared,
  approved, sent, acknowledged; the decisions and measures, Art. 33(5));
- ``audit-extract.jsonl``: the contiguous slice of the audit chain from the incident's first
  entry through a signed checkpoint appended at export; entries about the incident, its
  reports and notices keep their detail, the others only its digest (enough to recompute
  every hash, nothing about other incidents' content);
- ``keys.jwks``: the public key set at export;
- ``manifest.json`` (every other file's SHA-256) and ``manifest.sig``: the JWS over the
  manifest and every file.

Invariant: every file of the directory but ``manifest.sig`` is named in the signed
statement; a file added, removed or changed fails :func:`verify_case`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import sqlalchemy as sa
from sqlalchemy import select

from collector import audit
from collector import models as m
from collector.audit_checkpoints import CHECKPOINT, checkpoint
from collector.cases.register import decisions_for, notifications_for
from collector.db import Database
from collector.errors import InvalidInput, NotFound
from collector.reports.signed import (
    FileCheck,
    Unreadable,
    check_signed_file,
    report_json_bytes,
)
from collector.settings import Settings
from collector.signing import SignatureInvalid, sha256_bytes, sha256_file, statement, verify
from collector.timefmt import iso, to_micros

if TYPE_CHECKING:
    from collector.reports.breach_model import BreachReport

FORMAT = "kvwatch-case-file/1"
MANIFEST = "manifest.json"
MANIFEST_SIG = "manifest.sig"
KEYS = "keys.jwks"
EXTRACT = "audit-extract.jsonl"
SENT = ("sent", "acknowledged")


class CaseFiles:
    def __init__(self, db: Database, settings: Settings):
        self.db = db
        self.settings = settings

    def export(self, incident_id: int, out: Path, *, actor: str, now: datetime) -> dict[str, Any]:
        """Write the case file of ``incident_id`` into ``out`` (created; must be empty);
        audit-logged as ``case.export``. Returns the manifest."""
        from collector.reports.breach import BreachScope, BreachService
        from collector.reports.breach_model import from_document
        from collector.reports.stored import ReportStore

        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise InvalidInput(f"{out}: not an empty directory (a case file needs its own)")
        with self.db.read() as conn:
            found = conn.execute(select(m.Incident.id).where(m.Incident.id == incident_id))
            if found.first() is None:
                raise NotFound(f"no incident {incident_id}")
        service = BreachService(self.db, self.settings)
        store = ReportStore(self.db)
        rid = self._newest_signed_report(incident_id)
        if rid is None:
            rid = service.create(
                BreachScope(incident_id=incident_id), created_by=actor, now=now
            ).report_id
        doc = store.get(rid)
        signature = store.signature(rid)
        assert signature is not None  # _newest_signed_report, or signed just now
        report = from_document(doc)
        with self.db.write() as conn:
            checkpoint(conn, self.settings.key_ring(), actor=actor, now=now)
        # Written into a staging directory renamed to ``out`` once whole: an export that fails
        # midway (rows erased since the report) leaves no half case file.
        staging = out.parent / f".{out.name}.part"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            detail = self._write(
                incident_id, rid, doc, report, signature, staging, actor=actor, now=now
            )
            if out.exists():
                out.rmdir()  # empty, checked above
            staging.rename(out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        with self.db.write() as conn:
            audit.append(
                conn,
                now_us=to_micros(now),
                actor=actor,
                action="case.export",
                subject=f"incident:{incident_id}",
                detail=detail,
            )
        return cast(dict[str, Any], json.loads((out / MANIFEST).read_text(encoding="utf-8")))

    def _write(
        self,
        incident_id: int,
        rid: str,
        doc: dict[str, Any],
        report: BreachReport,
        signature: str,
        out: Path,
        *,
        actor: str,
        now: datetime,
    ) -> dict[str, Any]:
        """Every file into ``out``; returns the ``case.export`` entry's detail."""
        from collector.reports.breach import BreachService
        from collector.reports.breach_pdf import render_pdf

        service = BreachService(self.db, self.settings)
        ring = self.settings.key_ring()
        written: dict[str, bytes] = {}
        stem = f"breach-{rid}"
        written[f"{stem}.json"] = report_json_bytes(doc)
        with (out / f"{stem}.csv").open("wb") as fh:  # streamed: it can list millions of rows
            service.write_csv(report, fh.write)
        written[f"{stem}.pdf"] = render_pdf(report)
        written[f"{stem}.sig"] = signature.encode()
        written["stale-reads.json"] = report_json_bytes(doc["stale_reads"])
        with self.db.read() as conn:
            notifications = notifications_for(conn, incident_id)
            decisions = decisions_for(conn, incident_id)
            sent = [n for n in notifications if n.state in SENT]
            bodies = dict(
                conn.execute(
                    select(m.IncidentNotification.notice_id, m.IncidentNotification.notice).where(
                        m.IncidentNotification.notice_id.in_([n.notice_id for n in sent])
                    )
                ).all()
            )
            subjects = {f"incident:{incident_id}", f"report:{rid}"}
            subjects |= {f"report:{r}" for r in self._reports_of(conn, incident_id)}
            subjects |= {f"notice:{n.notice_id}" for n in notifications}
            extract = _extract(audit.entries(conn), subjects)
        for n in sent:
            written[f"{n.notice_id}.json"] = report_json_bytes(json.loads(bodies[n.notice_id]))
            if n.signature:
                written[f"{n.notice_id}.sig"] = n.signature.strip().encode()
        written["notifications.json"] = report_json_bytes(
            {"incident_id": incident_id, "notifications": [asdict(n) for n in notifications]}
        )
        written["decisions.json"] = report_json_bytes(
            {"incident_id": incident_id, "decisions": [asdict(d) for d in decisions]}
        )
        written[EXTRACT] = "".join(
            json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in extract
        ).encode()
        written[KEYS] = (json.dumps(ring.public_set(), indent=2) + "\n").encode()
        for name, data in written.items():
            (out / name).write_bytes(data)
        files = {p.name: sha256_file(p) for p in sorted(out.iterdir())}
        signed_cp = [r for r in extract if r["action"] == CHECKPOINT]
        manifest = {
            "format": FORMAT,
            "incident_id": incident_id,
            "exported_at": iso(now),
            "exported_by": actor,
            "report_id": rid,
            "evidence_sha256": doc["evidence_sha256"],
            "notices": [n.notice_id for n in sent],
            "decisions": len(decisions),
            "audit": {
                "first_entry": extract[0]["id"] if extract else None,
                "checkpoint_entry": signed_cp[-1]["id"] if signed_cp else None,
                "entries": len(extract),
            },
            "files": files,
        }
        mbytes = report_json_bytes(manifest)
        (out / MANIFEST).write_bytes(mbytes)
        claims = statement(
            sub=f"case:incident:{incident_id}",
            iat=now,
            files={**files, MANIFEST: sha256_bytes(mbytes)},
            conclusions={
                "incident_id": incident_id,
                "report_id": rid,
                "evidence_sha256": doc["evidence_sha256"],
                "notices": manifest["notices"],
                "decisions": len(decisions),
            },
        )
        token = ring.sign(claims, now=now)
        (out / MANIFEST_SIG).write_text(token, encoding="ascii")
        return {
            "report_id": rid,
            "manifest_sha256": sha256_bytes(mbytes),
            "signature_sha256": hashlib.sha256(token.encode()).hexdigest(),
            "files": len(files) + 2,
        }

    def _newest_signed_report(self, incident_id: int) -> str | None:
        """The newest stored, signed breach report of the incident (the one on file)."""
        r = m.Report
        with self.db.read() as conn:
            rows = conn.execute(
                select(r.report_id, r.scope)
                .where(r.kind == "breach", r.signature.is_not(None))
                .order_by(r.created_at.desc(), r.id.desc())
            ).all()
        for report_id, scope in rows:
            if json.loads(scope).get("incident_id") == incident_id:
                return str(report_id)
        return None

    @staticmethod
    def _reports_of(conn: sa.Connection, incident_id: int) -> list[str]:
        r = m.Report
        rows = conn.execute(select(r.report_id, r.scope).where(r.kind == "breach")).all()
        return [rid for rid, scope in rows if json.loads(scope).get("incident_id") == incident_id]


def _extract(rows: Iterable[dict[str, Any]], subjects: set[str]) -> list[dict[str, Any]]:
    """The chain from the first entry about ``subjects`` through the last checkpoint; the
    detail kept only for those entries and the checkpoints (the others' digests suffice to
    recompute their hashes)."""
    out: list[dict[str, Any]] = []
    for r in rows:
        mine = r["subject"] in subjects
        if not out and not mine:
            continue
        if not mine and r["action"] != CHECKPOINT and r["detail_sha256"] is not None:
            r = {**r, "detail": None}
        out.append(r)
    last_cp = max((i for i, r in enumerate(out) if r["action"] == CHECKPOINT), default=-1)
    return out[: last_cp + 1] if last_cp >= 0 else out


# ---------------------------------------------------------------------------- verifying


@dataclass
class CaseCheck:
    """A case file's check: ``lines`` what was found intact, ``problems`` what was not."""

    ok: bool = True
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    files: list[FileCheck] = field(default_factory=list)

    def fail(self, line: str) -> None:
        self.ok = False
        self.problems.append(line)


def verify_case(bundle: Path, key_set: Mapping[str, Any]) -> CaseCheck:
    """Check a case file offline: the manifest's signature, every file's hash against it (and
    no file it does not name), every member's own signature (the assessment's, each
    notice's, with what a forged one changed), and the audit extract: its chain and its
    signed checkpoint. Raises :class:`Unreadable` when ``bundle`` is not a case file."""
    try:
        token = (bundle / MANIFEST_SIG).read_text(encoding="ascii")
        manifest = json.loads((bundle / MANIFEST).read_text(encoding="utf-8"))
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}, not {FORMAT}")
    except (OSError, ValueError) as exc:
        raise Unreadable(f"{bundle}: not a case file ({exc})") from None
    out = CaseCheck()
    try:
        v = verify(token, key_set)
    except SignatureInvalid as exc:
        out.fail(f"{MANIFEST_SIG}: {exc.message}")
        return out
    state = f"retired {v.retired_at}" if v.retired_at else "current"
    out.lines.append(f"{MANIFEST_SIG}: {v.claims.get('sub')}, signed by key {v.kid} ({state})")
    signed: dict[str, str] = dict(v.claims.get("files", {}))
    present = {p.name for p in bundle.iterdir() if p.is_file()} - {MANIFEST_SIG}
    for name in sorted(present - set(signed)):
        out.fail(f"{name}: in the case file but not signed (added)")
    for name, want in sorted(signed.items()):
        path = bundle / name
        if not path.is_file():
            out.fail(f"{name}: signed but missing (removed)")
        elif sha256_file(path) != want:
            out.fail(f"{name}: SHA-256 {sha256_file(path)}, signed {want}")
    # every member with a signature of its own: what a forged one changed, path by path
    for sig in sorted(bundle.glob("*.sig")):
        if sig.name == MANIFEST_SIG:
            continue
        for member in sorted(bundle.glob(sig.stem + ".*")):
            if member.suffix == ".sig":
                continue
            try:
                fc = check_signed_file(member, key_set)
            except Unreadable as exc:
                out.fail(f"{member.name}: {exc}")
                continue
            out.files.append(fc)
            if fc.ok:
                out.lines.append(f"{member.name} ({fc.summary})")
            else:
                out.fail(f"{member.name}: {fc.summary}")
                out.problems += [f"  {p}" for p in fc.problems]
    _check_extract(bundle / EXTRACT, key_set, out)
    return out


def _check_extract(path: Path, key_set: Mapping[str, Any], out: CaseCheck) -> None:
    """The extract's hashes recomputed entry by entry, each chained to the one before, the
    kept details against their digests, and its checkpoint's signed head against the hash
    of the entry it names."""
    try:
        rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x]
    except (OSError, ValueError) as exc:
        out.fail(f"{EXTRACT}: unreadable ({exc})")
        return
    by_id: dict[int, str] = {}
    prev: str | None = None
    for r in rows:
        covered = r["detail"] if r["detail_sha256"] is None else r["detail_sha256"]
        h = audit._digest(
            r["prev_hash"], int(r["ts"]), r["actor"], r["action"], r["subject"], covered
        )
        if h != r["hash"]:
            out.fail(f"{EXTRACT}: entry {r['id']} does not match its hash (edited)")
            return
        kept = r["detail"] is not None and r["detail_sha256"] is not None
        if kept and audit._sha(r["detail"]) != r["detail_sha256"] and r.get("redacted_by") is None:
            out.fail(f"{EXTRACT}: entry {r['id']}'s detail is not the one hashed (edited)")
            return
        if prev is not None and r["prev_hash"] != prev:
            out.fail(f"{EXTRACT}: entry {r['id']} is not chained to the one before it")
            return
        prev = r["hash"]
        by_id[int(r["id"])] = r["hash"]
    cps = [r for r in rows if r["action"] == CHECKPOINT]
    if not cps:
        out.fail(f"{EXTRACT}: no signed checkpoint: its entries cannot be tied to the key")
        return
    last = cps[-1]
    try:
        claims = verify(json.loads(last["detail"])["jws"], key_set).claims["conclusions"]
    except (SignatureInvalid, ValueError, KeyError, TypeError) as exc:
        out.fail(f"{EXTRACT}: checkpoint {last['id']} does not verify ({exc})")
        return
    eid = int(claims["entry_id"])
    if by_id.get(eid) != claims["head"]:
        out.fail(
            f"{EXTRACT}: checkpoint {last['id']} signed entry {eid} as {claims['head']}; the "
            f"extract has {by_id.get(eid)}: rewritten without the signing key"
        )
        return
    out.lines.append(
        f"{EXTRACT}: {len(rows)} entries chained, signed through entry {eid} by checkpoint "
        f"{last['id']}"
    )
