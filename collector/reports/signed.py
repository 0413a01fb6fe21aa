"""Signed report files, and the check that names what a forged one changed.

Convention (every signed set of kvwatch files follows it: reports, reviews, notices, case
files): files sharing a stem ``S`` (``breach-rpt_x.json``, ``.csv``, ``.pdf``) have their
compact JWS in ``S.sig`` beside them. The statement (:func:`collector.signing.statement`)
names each file's SHA-256 under its basename (``files``) and the conclusions as a flat map
of dotted JSON paths (``conclusions``: ``timeline.deadline_at``, ``art34.verdict``), and,
for a PDF, what the PDF shows of them (``pdf``: path -> text). A verifier that finds a file's
hash not the signed one says which conclusion differs: a JSON path by path, a CSV by
recounting its rows, a PDF by reading its text back.

Invariant: the bytes signed are the bytes every view serves: :func:`report_json_bytes` is
the JSON the CLI writes and the API serves, the PDF renders deterministically (its creation
date is the report's ``generated_at``) and the CSV is streamed from the same rows.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from collector.errors import CollectorError
from collector.signing import (
    KeyRing,
    SignatureInvalid,
    Verified,
    sha256_bytes,
    statement,
    verify,
)

if TYPE_CHECKING:
    from collector.reports.breach import BreachService
    from collector.reports.breach_model import BreachReport

SIG_SUFFIX = ".sig"


def report_json_bytes(doc: Mapping[str, Any]) -> bytes:
    """A report's JSON file, byte for byte (the CLI writes it, the API serves it)."""
    return (json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def sig_path(path: Path) -> Path:
    """Where the signature of ``path`` lives: its stem with ``.sig``."""
    return path.with_suffix(SIG_SUFFIX)


def review_conclusions(doc: Mapping[str, Any]) -> dict[str, Any]:
    """What a quarterly review's signature states: every section but the rows (which
    ``evidence_sha256`` covers), as dotted paths."""
    from collector.reports.breach_model import flatten

    out: dict[str, Any] = {}
    for k, v in doc.items():
        if k != "rows":
            flatten(v, k, out, frozenset())
    return out


def sign_breach(service: BreachService, report: BreachReport, now: datetime) -> str:
    """The signature of a breach report's three files (``breach-<id>.json/.csv/.pdf``): the
    JSON and PDF rendered here, the CSV's rows streamed from the database into the hash."""
    from collector.reports.breach_model import signed_conclusions, to_document
    from collector.reports.breach_pdf import pdf_claims, render_pdf

    doc = to_document(report)
    stem = f"breach-{report.report_id}"
    h = hashlib.sha256()
    service.write_csv(report, h.update)
    claims = statement(
        sub=f"report:{report.report_id}",
        iat=now,
        files={
            f"{stem}.json": sha256_bytes(report_json_bytes(doc)),
            f"{stem}.csv": h.hexdigest(),
            f"{stem}.pdf": sha256_bytes(render_pdf(report)),
        },
        conclusions=signed_conclusions(doc),
    )
    claims["pdf"] = {f"{stem}.pdf": pdf_claims(report)}
    return service.settings.key_ring().sign(claims, now=now)


def sign_review(ring: KeyRing, doc: Mapping[str, Any], now: datetime) -> str:
    """The signature of a quarterly review's three files (``review-<id>.json/.csv/.pdf``)."""
    from collector.reports.review import to_csv
    from collector.reports.review_pdf import render_pdf

    stem = f"review-{doc['report_id']}"
    claims = statement(
        sub=f"report:{doc['report_id']}",
        iat=now,
        files={
            f"{stem}.json": sha256_bytes(report_json_bytes(doc)),
            f"{stem}.csv": sha256_bytes(to_csv(dict(doc)).encode()),
            f"{stem}.pdf": sha256_bytes(render_pdf(dict(doc))),
        },
        conclusions=review_conclusions(doc),
    )
    return ring.sign(claims, now=now)


# ---------------------------------------------------------------------------- verifying


class Unreadable(CollectorError):
    """A file or its signature cannot be read at all (exit 2, not "altered")."""

    status = 422
    code = "unreadable"


@dataclass
class FileCheck:
    """The check of one file: ``ok`` intact; ``problems`` what differs, one line each."""

    path: Path
    ok: bool
    signed: Verified | None = None
    summary: str = ""
    problems: list[str] = field(default_factory=list)


def key_words(v: Verified) -> str:
    state = f"retired {v.retired_at}" if v.retired_at else "current"
    return f"key {v.kid} ({state})"


def check_signed_file(path: Path, key_set: Mapping[str, Any]) -> FileCheck:
    """Check ``path`` against the signature beside it (:func:`sig_path`). Raises
    :class:`Unreadable` when the file or signature cannot be read; a signature that does not
    verify (unknown key, bad signature) or a file that is not the signed one is a failed
    check naming why."""
    sig = sig_path(path)
    try:
        token = sig.read_text(encoding="ascii")
        data = path.read_bytes()
    except (OSError, UnicodeDecodeError) as exc:
        raise Unreadable(f"{getattr(exc, 'filename', None) or sig}: {exc}") from None
    try:
        v = verify(token, key_set)
    except SignatureInvalid as exc:
        return FileCheck(path, False, None, f"the signature {sig.name} is invalid", [exc.message])
    files = v.claims.get("files", {})
    sub = v.claims.get("sub", "?")
    if path.name not in files:
        return FileCheck(
            path,
            False,
            v,
            f"{sig.name} ({sub}) does not cover {path.name}",
            [f"it signs {', '.join(sorted(files)) or 'no files'}"],
        )
    digest = sha256_bytes(data)
    if digest == files[path.name]:
        return FileCheck(path, True, v, f"{sub}, signed by {key_words(v)}")
    problems = [f"SHA-256 {digest}, signed {files[path.name]}"]
    problems += _what_differs(path, data, v.claims, key_set)
    return FileCheck(path, False, v, f"{sub}, not the file signed by {key_words(v)}", problems)


def _what_differs(
    path: Path, data: bytes, claims: Mapping[str, Any], key_set: Mapping[str, Any]
) -> list[str]:
    diagnose: dict[str, Callable[[], list[str]]] = {
        ".json": lambda: _json_diff(data, claims.get("conclusions", {})),
        ".csv": lambda: _csv_diff(path, data, claims, key_set),
        ".pdf": lambda: _pdf_diff(data, claims.get("pdf", {}).get(path.name, {})),
    }
    how = diagnose.get(path.suffix)
    if how is None:
        return []
    try:
        return how()
    except Unreadable as exc:
        return [str(exc)]


def _show(v: Any) -> str:
    return "(absent)" if v is _ABSENT else json.dumps(v, ensure_ascii=False)


_ABSENT = object()


def _json_diff(data: bytes, signed: Mapping[str, Any]) -> list[str]:
    """Path by path: every signed conclusion the file states otherwise (or not at all)."""
    from collector.reports.breach_model import EVIDENCE_KEYS, evidence_digest, flatten

    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise Unreadable(f"not JSON any more ({exc})") from None
    now: dict[str, Any] = {}
    if isinstance(doc, dict):
        for k, v in doc.items():
            flatten(v, k, now, frozenset())
    out = []
    for p, want in signed.items():
        got = lookup(doc, p)
        if got != want:
            out.append(f"{p}: signed {_show(want)}, file says {_show(got)}")
    # an item added beside signed ones (a checklist entry, a reason) the signature never saw
    parents = {p.rpartition(".")[0] for p in signed}
    extra = sorted(p for p in now if p not in signed and p.rpartition(".")[0] in parents)
    out += [f"{p}: not signed, file says {_show(now[p])}" for p in extra]
    if (
        isinstance(doc, dict)
        and doc.get("kind") == "breach"
        and "evidence_sha256" in signed
        and all(k in doc for k in EVIDENCE_KEYS)
    ):
        got_ev = evidence_digest(doc)
        if got_ev != signed["evidence_sha256"]:
            out.append(
                f"evidence ({', '.join(EVIDENCE_KEYS)}): hashes to {got_ev}, signed "
                f"{signed['evidence_sha256']}"
            )
    if not out:
        out.append("every signed conclusion is unchanged (re-serialised, or changed elsewhere)")
    return out


def lookup(doc: Any, path: str) -> Any:
    """The value at a dotted path (object keys, list indices); :data:`_ABSENT` when none."""
    node = doc
    for part in path.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _ABSENT
    return node


def _csv_diff(
    path: Path, data: bytes, claims: Mapping[str, Any], key_set: Mapping[str, Any]
) -> list[str]:
    """Recount the rows against the report, read from the signed JSON beside the CSV (only
    when that JSON is itself the signed one: a forged JSON proves nothing)."""
    from collector.reports.breach import check_csv
    from collector.reports.breach_model import UnreadableReport, from_document

    json_path = path.with_suffix(".json")
    if json_path.name not in claims.get("files", {}):
        return []
    try:
        raw = json_path.read_bytes()
    except OSError:
        return [f"{json_path.name} is not beside it: the rows cannot be recounted"]
    if sha256_bytes(raw) != claims["files"][json_path.name]:
        return [f"{json_path.name} is not the signed one either: the rows cannot be recounted"]
    doc = json.loads(raw)
    if doc.get("kind") != "breach":
        return []
    try:
        report = from_document(doc)
    except UnreadableReport as exc:
        return [exc.message]
    wrong = check_csv(report, io.StringIO(data.decode("utf-8", errors="replace"), newline=""))
    if not wrong:
        return []
    return [f"{path.name} is not the affected-request list of {json_path.name}:", *wrong]


_FOOTER = re.compile(r"kvwatch [^\n]*?page \d+ of \d+|page \d+ of \d+")


def _squash(text: str) -> str:
    """The text with every page's footer and all whitespace removed: a paragraph that runs
    across a page break reads as it was written."""
    return "".join(_FOOTER.sub("", text).split())


def _clip(text: str, n: int = 160) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def pdf_text(data: bytes) -> str:
    """Every page's text, read back with pypdf."""
    import pypdf

    try:
        reader = pypdf.PdfReader(io.BytesIO(data))
        return "\n".join(p.extract_text() or "" for p in reader.pages)
    except Exception as exc:  # pypdf raises many kinds on a damaged file
        raise Unreadable(f"not a readable PDF any more ({type(exc).__name__}: {exc})") from None


def _pdf_diff(data: bytes, shown: Mapping[str, str]) -> list[str]:
    """The signed conclusions whose rendered text the PDF no longer holds, and what it shows
    where that text was (the rest of the line that starts as the signed text did). Nothing
    when the signature records no rendered text for this PDF (only its hash)."""
    if not shown:
        return []
    raw = _FOOTER.sub("", pdf_text(data))
    text = _squash(raw)
    out = []
    for p, want in shown.items():
        if _squash(want) in text:
            continue
        words = want.split()
        instead = ""
        for k in range(len(words) - 1, 0, -1):  # the longest start still there: the label
            head = _squash(" ".join(words[:k]))
            if len(head) < 4 or head not in text:
                continue
            found = re.search(r"\s*".join(map(re.escape, head)), raw)
            if found is not None:
                end = raw.find("\n", found.end())
                line = " ".join(raw[found.start() : end if end >= 0 else None].split())
                instead = f"; it shows {_clip(line)!r} instead"
            break
        out.append(f"{p}: the PDF no longer shows {_clip(want)!r}{instead}")
    if not out:
        out.append("the PDF still shows every signed conclusion (changed elsewhere)")
    return out
