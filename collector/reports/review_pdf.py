"""The quarterly review PDF: a cover (report id, generation time, window, totals), the table
of every route and model against its safe threshold (highlighted rows marked), and one chart
per highlighted route: weekly max and p99 against the 80% and 100% lines. The incidents open
at any moment of the window lead the cover."""

from __future__ import annotations

import io
from datetime import datetime, timedelta
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.dates as mdates
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from collector.reports.pdf import ReportPdf
from collector.timefmt import parse_iso


def _n(v: Any) -> str:
    return "-" if v is None else f"{v:,}" if isinstance(v, int) else str(v)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def chart_span(row: dict[str, Any], until: datetime) -> tuple[datetime, datetime]:
    """The chart's time axis: from the first week with data to the end of the last one (the
    window's end at the latest), half a day either side so the end markers show whole.
    Matplotlib's own limits widen a single point to two years each way."""
    starts = [parse_iso(w["start"]) for w in row["trend"]["weeks"]]
    pad = timedelta(hours=12)
    return min(starts) - pad, min(max(starts) + timedelta(days=7), until) + pad


def chart_figure(row: dict[str, Any], until: datetime) -> Figure | None:
    """The highlighted row's weekly max and p99 against its thresholds (None: no weeks)."""
    weeks = row["trend"]["weeks"]
    if not weeks:
        return None
    x: Any = [parse_iso(w["start"]) for w in weeks]
    fig, ax = plt.subplots(figsize=(7.5, 2.6), dpi=110)
    try:
        ax.plot(x, [w["max"] for w in weeks], marker="o", markersize=3, label="max per week")
        ax.plot(x, [w["p99"] for w in weeks], marker="s", markersize=3, label="p99 per week")
        safe = row["safe_context"]
        if safe:
            ax.axhline(0.8 * safe, linestyle="--", linewidth=1, color="#e67e22", label="80%")
            ax.axhline(safe, linestyle="-", linewidth=1, color="#c0392b", label=f"safe {safe}")
        ax.set_title(f"{row['deployment_id']} {row['route'] or '-'} {row['model_id']}", fontsize=9)
        ax.set_ylabel("prompt tokens", fontsize=8)
        ax.tick_params(labelsize=7)
        lo, hi = chart_span(row, until)
        ax.set_xlim(mdates.date2num(lo), mdates.date2num(hi))
        ax.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=3, maxticks=8))
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%Y-%m-%d"))
        ax.legend(fontsize=7, loc="lower left")
        fig.autofmt_xdate()
        fig.tight_layout()
        return fig
    except BaseException:
        plt.close(fig)
        raise


def _chart(row: dict[str, Any], until: datetime) -> bytes | None:
    fig = chart_figure(row, until)
    if fig is None:
        return None
    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()
    finally:
        plt.close(fig)


def render_pdf(review: dict[str, Any]) -> bytes:
    rid = review["report_id"]
    pdf = ReportPdf(rid, "quarterly review", parse_iso(review["generated_at"]))
    sc, tot = review["scope"], review["totals"]
    pdf.add_page()
    pdf.set_font("DejaVu", "B", 20)
    pdf.cell(0, 14, "Quarterly review", new_x="LMARGIN", new_y="NEXT")
    pdf.set_font("DejaVu", "", 10)
    pdf.cell(
        0,
        6,
        "Prompt tokens per route and model against the safe threshold",
        new_x="LMARGIN",
        new_y="NEXT",
    )
    pdf.ln(4)
    pdf.kv(
        [
            ("Report ID", rid),
            ("Generated at", review["generated_at"]),
            ("Window", f"{sc['since']} to {sc['until']} ({sc['weeks']} weeks)"),
            ("Deployment", sc["deployment_id"] or "all"),
            ("Requests", _n(tot["requests"])),
            # their probe went away before they ended (absent from reviews stored before)
            ("Lost requests", _n(tot.get("lost_requests", 0))),
            ("Routes and models", tot["routes"]),
            (f"Highlighted (>= {review['highlight_ratio']:.0%})", tot["highlighted"]),
        ]
    )
    # .get: a review stored before incidents were part of it has none
    incidents = review.get("incidents", [])
    pdf.h1("Incidents in the window")
    pdf.grid(
        ["#", "deployment", "title", "opened", "state", "deadline"],
        [
            [
                str(i["id"]),
                i["deployment_id"],
                i["title"],
                i["opened_at"],
                i["state"] if i["closed_at"] is None else f"closed {i['closed_at']}",
                i["deadline_at"],
            ]
            for i in incidents
        ]
        or [["", "no incident was open in the window", "", "", "", ""]],
        [8, 24, 44, 36, 30, 36],
    )
    pdf.para(
        "p99 is the exact nearest-rank 99th percentile. The threshold is the latest passing "
        "verification of the deployment and model whose settings still match its nodes "
        "(verified), else min(advertised context, prefill pool) (unverified). A row is "
        "highlighted when its max or p99 reaches 80% of the threshold. Slopes are least "
        "squares over the weekly values, in tokens per week. Refused requests (the engine turned "
        "the prompt away) count as requests but never in the max, the p99 or a highlight. "
        "Deployments with an incident in the window come first."
    )
    pdf.h1("Routes and models")
    pdf.grid(
        [
            "",
            "deployment",
            "route",
            "model",
            "requests",
            "max",
            "p99",
            "threshold",
            "max %",
            "p99 %",
            "p99 slope/wk",
        ],
        [
            [
                "!!" if r["highlighted"] else "",
                r["deployment_id"],
                r["route"],
                r["model_id"],
                _n(r["requests"]),
                _n(r["max_prompt_tokens"]),
                _n(r["p99_prompt_tokens"]),
                f"{_n(r['safe_context'])}{'' if r['verified'] else ' (unverified)'}",
                _pct(r["max_ratio"]),
                _pct(r["p99_ratio"]),
                r["trend"]["p99_slope_per_week"],
            ]
            for r in review["rows"]
        ]
        or [["", "no requests in the window", "", "", "", "", "", "", "", "", ""]],
        [6, 20, 26, 18, 14, 16, 16, 24, 12, 12, 16],
    )
    high = [r for r in review["rows"] if r["highlighted"]]
    if high:
        pdf.add_page()
        pdf.h1("Highlighted routes")
        for r in high:
            pdf.para(
                f"{r['deployment_id']} {r['route'] or '-'} {r['model_id']}: max "
                f"{_n(r['max_prompt_tokens'])} ({_pct(r['max_ratio'])}), p99 "
                f"{_n(r['p99_prompt_tokens'])} ({_pct(r['p99_ratio'])}) of "
                f"{_n(r['safe_context'])} ({'verified' if r['verified'] else 'unverified'})"
            )
            png = _chart(r, parse_iso(sc["until"]))
            if png is not None:
                pdf.image(io.BytesIO(png), w=pdf.epw)
    return bytes(pdf.output())
