"""The audit PDF of a breach report: cover (report id, generation time, scope, evidence
SHA-256), summary figures, charts (matplotlib, Agg, PNG in memory), tables, the Art. 33(3)
checklist and Art. 34 decision support; every page's footer names the report and the page."""

from __future__ import annotations

import io
from collections.abc import Sequence
from datetime import timedelta
from itertools import pairwise
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.dates as mdates
import matplotlib.pyplot as plt
import msgspec
from matplotlib.ticker import Formatter, FuncFormatter, MaxNLocator, StrMethodFormatter

from collector.reports.breach_model import (
    EVIDENCE_KEYS,
    Art34,
    BreachReport,
    ChartWindow,
    DataCategories,
    Point,
    StaleReads,
    page_split,
)
from collector.reports.pdf import ReportPdf, figure, short_time
from collector.timefmt import parse_iso
from policies.limits import strictest

MAX_TABLE_ROWS = 200
WARN, CRIT = "#e67e22", "#c0392b"  # the 80% line and the 100% line (as on the dashboard)
SUMMARY_NOTES = [
    (
        "Affected requests",
        "the requests on either side of a stale read in scope (those that read, and those "
        "whose pages were read); in a window report, every request in the window.",
    ),
    (
        "By status",
        "how the affected requests ended; lost: the probe that admitted one went away (stopped, "
        "replaced by a restarted engine's probe, or silent) before it said how it ended.",
    ),
    ("Largest prompt", "the longest prompt, in tokens, among the affected requests."),
    (
        "Stale reads",
        "reads of KV pages the reading request did not write; cross-tenant: last written by "
        "another tenant's request; pages: all pages those reads covered, then how many held "
        "another tenant's data and how many no one's (never written). The previous "
        "tenant is the probe's page ledger's last recorded writer of those pages, not what "
        "the engine's own block tables say.",
    ),
    (
        "Exposed tenants, requests",
        "the tenants (customers) and requests whose KV pages another tenant's request read.",
    ),
    (
        "Receiving tenants, requests",
        "the tenants and requests that read another tenant's KV pages (their answers may contain "
        "it): counted apart from the exposed requests, the records concerned.",
    ),
    (
        "Data subjects concerned",
        "the persons the exposed prompts concern: kvwatch stores no prompt text and cannot "
        "count them; the exposed tenant (the controller) can.",
    ),
    (
        "Declared population",
        "the persons whose data the exposed requests' tenant or route carries, as the data map "
        "declares it (shown only where it declares one for every exposed request): not the "
        "number of persons concerned.",
    ),
    (
        "Special categories",
        "the categories declared in the data map (KVWATCH_DATA_MAP) or tagged on the exposed "
        "requests; never guessed.",
    ),
    (
        "Awareness, deadline",
        "when the incident was opened (the operator's awareness), and 72 hours later (Art. "
        "33(1)), as the audit log records them (a change is logged with who and why). Late: "
        "judged from the notices recorded as sent (kvwatch incidents notify), never from when "
        "this report was generated; the deadline rule says whose notice counts for the "
        "operator's role.",
    ),
]


def _data_subjects(cats: DataCategories) -> str:
    if cats.data_subjects is None:
        return "unknown (a prompt may concern any number of persons)"
    return f"{cats.data_subjects:,}"


def _population(cats: DataCategories) -> str:
    if cats.population is None:
        return "not declared"
    where = f" in the data map {cats.data_map}" if cats.data_map else ""
    return f"{cats.population:,} persons (declared{where}; not the number concerned)"


def _stale_reads(sr: StaleReads) -> str:
    split = page_split(sr)
    held = [f"{split.other_tenant:,} held another tenant's data"]
    if split.same_tenant:
        held.append(f"{split.same_tenant:,} the reader's own tenant's")
    if split.no_one:
        held.append(f"{split.no_one:,} no one's")
    return (
        f"{sr.count} ({sr.cross_tenant} cross-tenant); {sr.pages:,} pages read, of which "
        + ", ".join(held)
    )


def _chart(
    series: Sequence[Point],
    title: str,
    ylabel: str,
    lines: list[tuple[float, str, str]],
    kind: str = "line",
    window: ChartWindow | None = None,
    bucket_s: float | None = None,
) -> bytes | None:
    if not series:
        return None
    x: Any = [parse_iso(p.ts) for p in series]
    y = [p.value for p in series]
    # The report's own window when it has one (an incident's minutes, not a day); otherwise
    # a window of one point still needs a readable axis: at least ten minutes around it.
    span = max(x) - min(x)
    pad = max(span * 0.05, (timedelta(minutes=10) - span) / 2, timedelta(seconds=30))
    lo, hi = min(x) - pad, max(x) + pad
    if window is not None:
        lo, hi = parse_iso(window.from_), parse_iso(window.until)
    fig, ax = plt.subplots(figsize=(7.5, 2.6), dpi=110)
    try:
        gaps = [b - a for a, b in pairwise(x) if b > a]
        step = timedelta(seconds=bucket_s) if bucket_s else (min(gaps) if gaps else (hi - lo) / 48)
        if kind == "bar":
            # each bar as wide as its bucket, starting where the bucket starts; bars count
            # events, so the axis has whole numbers only
            ax.bar(x, y, width=step.total_seconds() / 86400, align="edge", color="#c0392b")
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        else:
            # a value stands for its whole bucket: a step as wide as it, a dot at its start
            ax.step([*x, x[-1] + step], [*y, y[-1]], where="post", color="#2c3e50", label=ylabel)
            ax.plot(x, y, "o", markersize=3, color="#2c3e50")
            ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.6g}"))
        for value, label, color in lines:
            ax.axhline(value, linestyle="--", linewidth=1, color=color, label=label)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_xlim(lo, hi)
        ax.set_ylim(bottom=0)
        ax.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=3, maxticks=8))
        ax.xaxis.set_major_formatter(_ticks(hi - lo))
        ax.set_xlabel(f"time (UTC), {lo:%Y-%m-%d}", fontsize=7)
        if lines:
            ax.legend(fontsize=7, loc="upper left")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()
    finally:
        plt.close(fig)


def _ticks(span: timedelta) -> Formatter:
    """Tick labels that tell each other apart: milliseconds for a burst of seconds, seconds at
    an incident's minutes, dates only across days (the date itself is in the axis title)."""
    if span < timedelta(seconds=20):
        return FuncFormatter(lambda v, _: mdates.num2date(v).strftime("%H:%M:%S.%f")[:-3])
    if span < timedelta(hours=1):
        return mdates.DateFormatter("%H:%M:%S")
    return mdates.DateFormatter("%H:%M" if span < timedelta(days=1) else "%m-%d %H:%M")


def _n(v: Any) -> str:
    return f"{v:,}" if isinstance(v, int) else "-" if v is None else str(v)


def page_ranges(pages: Sequence[int]) -> str:
    """``10-741, 800 (733 pages)``: runs of consecutive ids as ranges, never an ellipsis
    mid-list; past eight runs, the first ones and how many more."""
    ids = sorted(set(pages))
    runs: list[str] = []
    start = prev = None
    for p in [*ids, None]:
        if start is not None and (p is None or p != prev + 1):  # type: ignore[operator]
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if p is not None:
            start = p if start is None else start
            prev = p
    shown = runs if len(runs) <= 8 else [*runs[:8], f"and {len(runs) - 8} more runs"]
    return f"{', '.join(shown)} ({len(ids)} page{'s' if len(ids) != 1 else ''})"


def _special(cats: DataCategories) -> str:
    if cats.special:
        return ", ".join(cats.special)
    if cats.exposed_undeclared:
        return f"unknown: {cats.exposed_undeclared} exposed request(s) declare no categories"
    return "none declared"


def _art34_page(pdf: ReportPdf, a34: Art34) -> None:
    pdf.h1("Art. 34 decision support")
    pdf.para(f"High risk: {a34.verdict}. Rule: {a34.rule}.")
    for reason in a34.reasons:
        pdf.para(f"- {reason}")
    pdf.para(a34.note)


def summary_rows(report: BreachReport) -> list[tuple[str, Any]]:
    """The summary's label and value rows, as the PDF prints them; the signature records what
    the PDF shows of each signed conclusion from the same rows (:func:`pdf_claims`)."""
    ar, tn, sr = report.affected_requests, report.tenants, report.stale_reads
    tl, cats, a34 = report.timeline, report.data_categories, report.art34
    return [
        ("Affected requests", ar.count),
        # lost: the probe that admitted it went away before it finished
        ("By status", ", ".join(f"{k} {n:,}" for k, n in ar.by_status.items()) or "—"),
        ("Largest prompt (tokens)", ar.max_prompt_tokens),
        ("Stale reads", _stale_reads(sr)),
        ("Where data crossed", ", ".join(report.involved_deployments) or "none"),
        ("Exposed tenants", tn.exposed_count),
        ("Exposed requests (records concerned)", tn.exposed_requests),
        ("Receiving tenants", tn.receiving_count),
        ("Receiving requests", tn.receiving_requests),
        ("Data subjects concerned", _data_subjects(cats)),
        ("Declared population", _population(cats)),
        ("Special categories", _special(cats)),
        ("First event", tl.first_event_at),
        ("Last event", tl.last_event_at),
        ("Awareness", tl.awareness_at),
        ("Art. 33 deadline", tl.deadline_at),
        ("Deadline rule", tl.deadline_rule),
        ("Late", "yes" if tl.late else "no"),
        ("Late reason", tl.late_reason),
        ("Art. 34 high risk", a34.verdict),
    ]


# The summary rows that state a signed conclusion: label -> its dotted path in the JSON.
_SUMMARY_PATHS = {
    "Affected requests": "affected_requests.count",
    "Largest prompt (tokens)": "affected_requests.max_prompt_tokens",
    "Exposed tenants": "tenants.exposed_count",
    "Exposed requests (records concerned)": "tenants.exposed_requests",
    "Receiving tenants": "tenants.receiving_count",
    "Receiving requests": "tenants.receiving_requests",
    "Awareness": "timeline.awareness_at",
    "Art. 33 deadline": "timeline.deadline_at",
    "Late": "timeline.late",
    "Late reason": "timeline.late_reason",
    "Art. 34 high risk": "art34.verdict",
}


def pdf_claims(report: BreachReport) -> dict[str, str]:
    """What the PDF shows of each signed conclusion (dotted path -> text), so a verifier
    reading a forged PDF's text back names the conclusions that are no longer there. Compared
    with all whitespace removed (a line may wrap anywhere)."""
    claims = {
        path: f"{label} {figure(value)}"
        for label, value in summary_rows(report)
        if (path := _SUMMARY_PATHS.get(label)) is not None
    }
    claims["evidence_sha256"] = f"Evidence SHA-256 {report.evidence_sha256}"
    claims["art34.rule"] = f"High risk: {report.art34.verdict}. Rule: {report.art34.rule}."
    for i, reason in enumerate(report.art34.reasons):
        claims[f"art34.reasons.{i}"] = f"- {reason}"
    for i, it in enumerate(report.checklist):
        claims[f"checklist.{i}.value"] = it.value + (f" (note: {it.note})" if it.note else "")
    if report.account:
        claims["account"] = report.account
    return claims


def render_pdf(report: BreachReport) -> bytes:
    rid = report.report_id
    pdf = ReportPdf(rid, "breach assessment", parse_iso(report.generated_at))
    ar, tn, sr = report.affected_requests, report.tenants, report.stale_reads
    cats, a34 = report.data_categories, report.art34

    # ---- cover
    pdf.add_page()
    pdf.set_font("DejaVu", "B", 20)
    pdf.cell(0, 14, "Breach assessment", new_x="LMARGIN", new_y="NEXT")
    pdf.set_font("DejaVu", "", 10)
    pdf.cell(0, 6, "GDPR Art. 33 / Art. 34 - kvwatch", new_x="LMARGIN", new_y="NEXT")
    pdf.ln(4)
    scope = msgspec.structs.asdict(report.scope)
    scope_text = ", ".join(f"{k}={v}" for k, v in sorted(scope.items()) if v is not None)
    head: list[tuple[str, Any]] = [
        ("Report ID", rid),
        ("Generated at", report.generated_at),
        ("Mode", report.mode),
        ("Scope", scope_text),
    ]
    if (inc := report.incident) is not None:
        head.append(("Incident", f"#{inc.id} {inc.title} ({inc.state})"))
    head.append(("Evidence SHA-256", report.evidence_sha256))
    # The signature cannot be inside the bytes it signs: say where it is and how to check it.
    head.append(
        (
            "Signature",
            f"breach-{rid}.sig (Ed25519 JWS over this PDF, its JSON and CSV, and every "
            "conclusion): kvwatch report verify with the published key set",
        )
    )
    pdf.kv(head, mono={"Evidence SHA-256"})
    pdf.ln(4)
    pdf.h1("Summary")
    pdf.kv(summary_rows(report))
    pdf.ln(1)
    pdf.notes(SUMMARY_NOTES)
    pdf.para(
        "The evidence SHA-256 is computed over the canonical JSON (sorted keys, compact) of the "
        f"sections {', '.join(EVIDENCE_KEYS)} of the JSON report; `kvwatch report verify` "
        "recomputes it. The generation time is outside it: the same evidence gives the same "
        "hash.",
        8,
    )
    if report.account:
        pdf.ln(2)
        pdf.h1("What happened")
        pdf.para(report.account)
    if report.notices:
        pdf.ln(2)
        pdf.h1("Notices to tenants this implies (Art. 33(2))")
        pdf.grid(
            ["tenant", "concerns", "written by"],
            [
                [n.tenant, {"exposed": "its data was read", "received": "it received "
                            "another's data", "both": "both"}[n.kind], n.command]
                for n in report.notices
            ],
            [34, 36, 120],
        )  # fmt: skip
    if report.cause:
        pdf.ln(2)
        pdf.h1("Cause chain, in order")
        pdf.grid(
            ["when (UTC)", "step", "from the evidence"],
            [[short_time(x.at), x.step.replace("_", " "), x.text] for x in report.cause],
            [36, 34, 120],
        )

    # ---- charts
    pdf.add_page()
    pdf.h1("Charts")
    # the strictest limit in force of the report's deployments (policies.limits decided each)
    held = strictest(lim for d in report.deployments for lim in d.limits_in_force)
    lines = []
    if held is not None and held.tokens:
        lines = [
            (0.8 * held.tokens, f"80% of the limit in force ({int(0.8 * held.tokens):,})", WARN),
            (float(held.tokens), f"limit in force ({held.tokens:,}, {held.source})", CRIT),
        ]
    series = report.series
    win = series.window
    bucket_s = series.bucket_seconds
    width = f"{bucket_s:.3g}-second" if bucket_s else "equal"
    charts = [
        _chart(
            series.prompt_tokens_max,
            f"Prompt tokens: the largest per {width} bucket",
            "tokens",
            lines,
            window=win,
            bucket_s=bucket_s,
        ),
        _chart(
            series.pool_occupancy_max,
            f"Pool occupancy: the highest per {width} bucket",
            "used / capacity",
            [(1.0, "capacity (full)", CRIT)],
            window=win,
            bucket_s=bucket_s,
        ),
        _chart(
            series.stale_reads,
            f"Stale reads per {width} bucket",
            "stale reads",
            [],
            kind="bar",
            window=win,
            bucket_s=bucket_s,
        ),
    ]
    for title, png in zip(("Prompt tokens", "Pool occupancy", "Stale reads"), charts, strict=True):
        if png is None:
            pdf.para(f"{title}: no data in scope.")
        else:
            pdf.image(io.BytesIO(png), w=pdf.epw)
    pdf.notes(
        [
            (
                "Time axis",
                f"{win.from_} to {win.until}: "
                "for an incident, from the first event of its requests to its last stale read, "
                "with a margin (its own minutes, not a day).",
            ),
            (
                "Prompt tokens",
                "the largest prompt (in tokens) among the requests of the models in scope "
                "that started in each bucket; the dashed lines are 80% and 100% of the "
                "strictest limit in force of the deployments in scope.",
            ),
            (
                "Pool occupancy",
                "the highest used / capacity of any KV pool sample of the deployments in "
                "scope; at 1.0 the pool is full and the next allocation reuses pages.",
            ),
            ("Stale reads", "how many stale reads (of any tenant) were recorded in each bucket."),
        ]
    )

    # ---- tables
    pdf.add_page()
    pdf.h1("Tenants")
    pdf.grid(
        ["exposed tenant", "stale reads", "requests", "receiving tenants"],
        [[t.tenant, t.stale_reads, t.requests, ", ".join(t.receiving_tenants)] for t in tn.exposed],
        [40, 25, 25, 90],
    )
    pdf.grid(
        ["receiving tenant", "stale reads", "requests", "exposed tenants"],
        [[t.tenant, t.stale_reads, t.requests, ", ".join(t.exposed_tenants)] for t in tn.receiving],
        [40, 25, 25, 90],
    )
    pdf.h1("Data categories")
    pdf.grid(
        ["category", "affected requests", "exposed requests"],
        [
            [c, cats.affected.get(c, 0), cats.exposed.get(c, 0)]
            for c in sorted(set(cats.affected) | set(cats.exposed))
        ]
        or [["none", 0, 0]],
        [60, 60, 60],
    )
    pdf.h1("Stale-read evidence")
    items = sr.items[:MAX_TABLE_ROWS]
    pdf.grid(
        ["when", "reader request", "reader tenant", "previous request", "previous tenant", "pages"],
        [
            [
                short_time(s.ts),
                s.reader_request_id,
                s.reader_tenant,
                s.previous_request_id or "never written",
                s.previous_tenant or "no one",
                page_ranges(s.pages),
            ]
            for s in items
        ]
        or [["none", "", "", "", "", ""]],
        [36, 30, 25, 30, 25, 34],
    )
    pdf.notes(
        [
            (
                "A stale read",
                "a request read KV pages it did not write. Cross-tenant (the contract's one "
                "definition): the pages were last written by another tenant's request.",
            ),
            (
                "never written / no one",
                "the pages were read before any request wrote them since the pool was made: "
                "they held no one's data (a zeroed or unused page), so no tenant is exposed by "
                "that row; it is listed because reading them is the defect's own symptom.",
            ),
            ("pages", "the page ids read, as runs of consecutive ids, and how many pages."),
        ]
    )
    if sr.count > len(items):
        pdf.para(f"{len(items)} of {sr.count} stale reads shown; all are in the JSON report.")
    pdf.h1("Affected requests")
    reqs = ar.items[:MAX_TABLE_ROWS]
    pdf.grid(
        ["request", "tenant", "deployment", "prompt", "status", "role", "first seen"],
        [
            [
                r.request_id,
                r.tenant,
                r.deployment_id,
                r.prompt_tokens,
                r.status,
                r.role.replace("_", " "),
                short_time(r.first_ts),
            ]
            for r in reqs
        ]
        or [["none", "", "", "", "", "", ""]],
        [24, 28, 26, 16, 22, 26, 36],
    )
    pdf.notes(
        [
            (
                "role",
                "reader: the request read another request's pages; previous writer: its pages "
                "were read by another request; both: each; in window: in a window report's "
                "window, on neither side.",
            ),
            ("prompt", "the request's prompt length in tokens, as the engine counted it."),
        ]
    )
    if ar.count > len(reqs):
        pdf.para(
            f"{len(reqs)} of {ar.count} affected requests shown; the CSV export lists {ar.listed}."
        )
    pdf.h1("Deployments")
    for d in report.deployments:
        pdf.para(
            f"{d.deployment_id}: advertised context {_n(d.advertised_context)} tokens, "
            f"smallest prefill pool {_n(d.min_pool_capacity_tokens)}, limit in force "
            + (d.limit or "unknown")
        )
        pdf.grid(
            ["since", "node", "role", "engine", "pool", "advertised", "quant", "tp"],
            [
                [
                    short_time(c.ts),
                    c.node,
                    c.role,
                    f"{c.engine} {c.engine_version}",
                    c.pool_capacity_tokens,
                    c.advertised_context,
                    c.quantization,
                    c.tp_size,
                ]
                for c in d.configs
            ]
            or [["no config recorded", "", "", "", "", "", "", ""]],
            [36, 22, 16, 30, 22, 22, 16, 10],
        )
        pdf.grid(
            ["verified at", "model", "passed", "safe context", "engine"],
            [
                [
                    short_time(v.verified_at),
                    v.model_id,
                    v.passed,
                    v.verified_safe_context,
                    v.engine_version,
                ]
                for v in d.verifications
            ]
            or [["no verification recorded", "", "", "", ""]],
            [40, 50, 20, 30, 34],
        )

    # ---- checklist
    pdf.add_page()
    pdf.h1("GDPR Art. 33(3) checklist")
    for it in report.checklist:
        pdf.set_font("DejaVu", "B", 9)
        mark = "NEEDS A PERSON" if it.needs_person else "filled from data"
        pdf.multi_cell(0, 5, f"{it.article} {it.title} [{mark}]", new_x="LMARGIN", new_y="NEXT")
        pdf.para(it.value + (f" (note: {it.note})" if it.note else ""))
        pdf.ln(1)
    _art34_page(pdf, a34)
    pdf.ln(10)
    pdf.para("Assessed by (name, role): ______________________________")
    pdf.ln(4)
    pdf.para("Signature: ______________________________    Date: ______________")
    return bytes(pdf.output())
