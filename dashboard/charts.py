"""The dashboard's Altair charts: the ones where a person would rather look than read.

Each takes a small, already-aggregated DataFrame (the collector downsamples) and returns a
chart; the pages decide where it goes. Threshold lines are always drawn with their labels, so
a chart read on its own still says what the lines mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import altair as alt
import pandas as pd

# What .properties() and layering give back; st.altair_chart takes any of them.
AnyChart = alt.Chart | alt.LayerChart | alt.FacetChart

WARN = "#e8a317"  # the 80% line (warning)
CRIT = "#d62728"  # the 100% line (critical)
STATUS_COLORS = {"red": CRIT, "amber": WARN, "green": "#2ca02c"}
MEASURES = {
    "Advertised context": "#9e9e9e",
    "Prefill pool": "#1f77b4",
    "Verified safe context": "#2ca02c",
    "Limit in force": "#d62728",
}
# Every page-event kind the collector stores: the scale's domain is this list, so a kind left
# out would have no colour (prefix_cache.hit and kv.turnover once had none).
KINDS = {
    "kv.transfer": "#9ecae1",
    "page.reuse": "#6baed6",
    "kv.turnover": "#c6dbef",
    "source.gap": "#bdbdbd",  # an interval nobody could observe: grey, not data
    "prefix_cache.hit": "#fd8d3c",
    "page.stale_read": CRIT,
    "canary.hit": "#9467bd",
}


Window = tuple[datetime, datetime]


def _time_x(window: Window | None, title: str = "time (UTC)") -> alt.X:
    """Time on a UTC axis, spanning the whole window the page asked for: a gap with no data
    shows as a gap, and every chart of a page lines up."""
    domain: Any = alt.Undefined
    fmt = "%b %d %H:%M"
    if window is not None:
        domain = [_datetime(t) for t in window]
        fmt = _tick_format(window[1] - window[0])
    return alt.X(
        "time:T",
        title=title,
        scale=alt.Scale(type="utc", domain=domain),
        # 24-hour UTC, as the tables write times (a utc scale formats its ticks in UTC)
        axis=alt.Axis(format=fmt, labelOverlap=True),
    )


def _tick_format(span: timedelta) -> str:
    """Ticks that differ from one another: seconds (and milliseconds) once a chart is zoomed
    to a burst of events, the date only when the span crosses days."""
    if span < timedelta(seconds=20):
        return "%H:%M:%S.%L"
    if span < timedelta(hours=1):
        return "%H:%M:%S"
    if span < timedelta(days=1):
        return "%H:%M"
    return "%b %d %H:%M"


def _datetime(t: datetime) -> alt.DateTime:
    # Vega-Lite's own UTC date object: a bare epoch number is not read as a time here.
    u = t.astimezone(UTC)
    return alt.DateTime(
        year=u.year,
        month=u.month,
        date=u.day,
        hours=u.hour,
        minutes=u.minute,
        seconds=u.second,
        milliseconds=u.microsecond // 1000,
        utc=True,
    )


def _with_when(df: pd.DataFrame, column: str = "time") -> pd.DataFrame:
    """A UTC label for tooltips (Vega would show the browser's local time)."""
    return df.assign(when=pd.to_datetime(df[column], utc=True).dt.strftime("%Y-%m-%d %H:%M UTC"))


def _steps(
    df: pd.DataFrame, keys: list[str], bucket_s: float | None, *, break_gaps: bool = False
) -> pd.DataFrame:
    """``df`` with, per series (``keys``), its last row repeated at the end of its last
    bucket: a value stands for a whole bucket, so a step-after line draws every bucket as
    wide as it is, and a series of one bucket is a segment, not a dot.

    ``break_gaps``: for counts of events (prompts per bucket), where a bucket without a row
    had none, each run of consecutive buckets is a ``segment`` of its own (ended at its last
    bucket's end), so no flat line bridges the empty buckets between. A gauge (the pool's
    occupancy) holds its value between samples and is drawn through."""
    if df.empty or not bucket_s:
        return df.assign(segment=0)
    step = pd.Timedelta(seconds=bucket_s)
    ordered = df.sort_values([*keys, "time"]).reset_index(drop=True)
    same_series = (ordered[keys] == ordered[keys].shift()).all(axis=1)
    starts = ~same_series
    if break_gaps:
        # a bucket that follows its predecessor by more than one bucket starts a new run
        starts |= ordered["time"] - ordered["time"].shift() > step * 1.5
    ordered["segment"] = starts.cumsum()
    last = ordered.groupby("segment", as_index=False).tail(1).copy()
    last["time"] = last["time"] + step
    return pd.concat([ordered, last], ignore_index=True)


MARKERS = {"incident opened": CRIT, "stale read": "#7b1fa2"}


MARKER_ROWS = 3  # label rows: markers close in time take turns, so labels never overlap
MARKER_ROW_PX = 13
MARKER_FLIP = 0.7  # a marker past this share of the window has its label on its left


def markers_frame(items: Sequence[tuple[Any, ...]], window: Window | None) -> pd.DataFrame:
    """Incident annotations from ``(time, marker, label, …)`` items (``marker``: a key of
    :data:`MARKERS`): those inside ``window`` only (a marker outside would stretch the
    axis). Each gets a label ``row`` (its pixel offset from the top: successive markers take
    the :data:`MARKER_ROWS` rows in turn) and a ``side``: ``right`` of its rule, or ``left``
    near the window's end, where a label on the right would run off the chart."""
    rows = [
        {"time": t, "marker": kind, "label": label}
        for t, kind, label, *_ in items
        if window is None or window[0] <= t <= window[1]
    ]
    df = pd.DataFrame(rows, columns=["time", "marker", "label"])
    df["time"] = pd.to_datetime(df["time"], utc=True)
    df = df.sort_values("time", kind="stable").reset_index(drop=True)
    df["row"] = [2 + (i % MARKER_ROWS) * MARKER_ROW_PX for i in range(len(df))]
    if window is None or df.empty:
        df["side"] = "right"
    else:
        lo, hi = (pd.Timestamp(w).tz_convert("UTC") for w in window)
        flip = lo + (hi - lo) * MARKER_FLIP
        df["side"] = ["left" if t > flip else "right" for t in df["time"]]
    return df


_LABEL_SIDES: tuple[tuple[str, Literal["left", "right"], int], ...] = (
    ("right", "left", 3),  # side of the rule, text alignment, offset
    ("left", "right", -3),
)


def _marker_layers(markers: pd.DataFrame | None, x: alt.X) -> list[alt.Chart]:
    """A vertical rule at each marker, its colour saying what it is, its label at the top,
    beside the rule on the side and in the row :func:`markers_frame` gave it."""
    if markers is None or markers.empty:
        return []
    scale = alt.Scale(domain=list(MARKERS), range=list(MARKERS.values()))
    color = alt.Color("marker:N", title=None, scale=scale, legend=alt.Legend(orient="top"))
    data = _with_when(markers)
    rule = (
        alt.Chart(data)
        .mark_rule(strokeWidth=2, opacity=0.85)
        .encode(x=x, color=color, tooltip=["marker:N", "label:N", alt.Tooltip("when:N")])
    )
    texts = [
        alt.Chart(data)
        .transform_filter(alt.datum.side == side)
        .mark_text(align=align, baseline="top", dx=dx, fontSize=10, fontWeight="bold")
        .encode(
            x=x,
            y=alt.Y("row:Q", scale=None),
            text="label:N",
            color=alt.Color("marker:N", scale=scale, legend=None),
        )
        for side, align, dx in _LABEL_SIDES
    ]
    return [rule, *texts]


def _across(df: pd.DataFrame, keys: list[str], window: Window | None) -> pd.DataFrame:
    """``df`` with each series' first value repeated at the window's start and its last at
    the window's end: a capacity drawn across the whole chart, as its legend promises."""
    if df.empty or window is None:
        return df
    ordered = df.sort_values("time").groupby(keys, as_index=False, dropna=False)
    first, last = ordered.head(1).copy(), ordered.tail(1).copy()
    first["time"] = pd.Timestamp(window[0]).tz_convert("UTC")
    last["time"] = pd.Timestamp(window[1]).tz_convert("UTC")
    return pd.concat([first, df, last], ignore_index=True)


def _bucket_points(df: pd.DataFrame, x: Any, y: Any, color: Any, tips: list[Any]) -> alt.Chart:
    """A dot at each bucket's start, its tooltip naming the bucket: drawn over the steps."""
    return (
        alt.Chart(_with_when(df))
        .mark_point(filled=True)
        .encode(x=x, y=y, color=color, tooltip=[alt.Tooltip("when:N", title="bucket"), *tips])
    )


def _lines(warn: int, critical: int, short: bool = False) -> pd.DataFrame:
    names = _SHORT if short else _LONG
    return pd.DataFrame({"line": names, "tokens": [warn, critical], "row": [16, 2]})


_LONG = ["80% of safe context", "100% of safe context"]
_SHORT = ["80%", "100%"]


def _line_scale() -> alt.Scale:
    return alt.Scale(domain=[*_LONG, *_SHORT], range=[WARN, CRIT, WARN, CRIT])


def fleet_limits(df: pd.DataFrame) -> AnyChart:
    """Per deployment and model: advertised context, prefill pool and verified safe context
    side by side, so a pool shorter than the advertised context stands out.

    Columns: ``target`` (deployment · model), ``measure``, ``tokens``."""
    base = alt.Chart(df).encode(
        y=alt.Y("target:N", title=None, sort=None, axis=alt.Axis(labelLimit=320)),
        yOffset=alt.YOffset("measure:N", sort=list(MEASURES)),
    )
    bars = base.mark_bar().encode(
        x=alt.X("tokens:Q", title="tokens", axis=alt.Axis(format="~s")),
        color=alt.Color(
            "measure:N",
            title=None,
            scale=alt.Scale(domain=list(MEASURES), range=list(MEASURES.values())),
            legend=alt.Legend(orient="bottom"),
        ),
        tooltip=[
            alt.Tooltip("target:N", title="deployment · model"),
            alt.Tooltip("measure:N"),
            alt.Tooltip("tokens:Q", format=","),
        ],
    )
    text = base.mark_text(align="left", dx=3, fontSize=10).encode(
        x="tokens:Q", text=alt.Text("tokens:Q", format=",")
    )
    return alt.layer(bars, text).properties(height=alt.Step(14))


def prompt_timeline(
    df: pd.DataFrame,
    warn: int | None,
    critical: int | None,
    window: Window | None = None,
    bucket_s: float | None = None,
    markers: pd.DataFrame | None = None,
) -> AnyChart:
    """Largest and p99 prompt per route and time bucket (each a step as wide as its bucket,
    with a point at its start; no line across buckets without requests), against the 80%
    and 100% lines, with incident markers (:func:`markers_frame`).

    p99 is drawn wide and pale under the thin max line, with its own point shape, so it shows
    where the two coincide (a bucket of a few requests), not only where they differ.

    Columns: ``time``, ``route``, ``stat`` (max | p99), ``tokens``, ``requests``."""
    x = _time_x(window)
    y = alt.Y("tokens:Q", title="prompt tokens", axis=alt.Axis(format="~s"))
    color = alt.Color("route:N", title="route", legend=alt.Legend(orient="bottom"))
    stat_scale = alt.Scale(domain=["max", "p99"])
    lines = (
        alt.Chart(_steps(df, ["route", "stat"], bucket_s, break_gaps=True))
        .mark_line(interpolate="step-after")
        .encode(
            x=x,
            y=y,
            color=color,
            detail="segment:N",
            strokeWidth=alt.StrokeWidth(
                "stat:N", title="prompt", scale=alt.Scale(domain=["max", "p99"], range=[1.5, 5])
            ),
            opacity=alt.Opacity(
                "stat:N", scale=alt.Scale(domain=["max", "p99"], range=[1, 0.45]), legend=None
            ),
            strokeDash=alt.StrokeDash(
                "stat:N",
                scale=alt.Scale(domain=["max", "p99"], range=[[1, 0], [4, 3]]),
                legend=None,
            ),
            order=alt.Order("stat:N", sort="descending"),  # p99 first, max drawn over it
        )
    )
    points = _bucket_points(
        df,
        x,
        y,
        alt.Color("route:N", legend=None),  # the lines' legend says it
        [
            "route:N",
            "stat:N",
            alt.Tooltip("tokens:Q", format=","),
            alt.Tooltip("requests:Q", format=","),
        ],
    ).encode(shape=alt.Shape("stat:N", scale=stat_scale, legend=None))
    layers: list[alt.Chart] = [lines, points]
    if warn is not None and critical is not None:
        layers.extend(_threshold_rules(_lines(warn, critical), "y"))
    layers.extend(_marker_layers(markers, x))
    return alt.layer(*layers).resolve_scale(color="independent").properties(height=280)


def _threshold_rules(lines: pd.DataFrame, axis: str) -> list[alt.Chart]:
    enc = {axis: alt.Y("tokens:Q") if axis == "y" else alt.X("tokens:Q")}
    rule = (
        alt.Chart(lines)
        .mark_rule(strokeDash=[6, 4], strokeWidth=2)
        .encode(
            color=alt.Color("line:N", title=None, scale=_line_scale(), legend=None),
            tooltip=["line:N", alt.Tooltip("tokens:Q", format=",")],
            **enc,
        )
    )
    text = (
        alt.Chart(lines)
        .mark_text(align="left", baseline="bottom", dx=4, dy=-2, fontWeight="bold")
        .encode(
            text="line:N",
            color=alt.Color("line:N", scale=_line_scale(), legend=None),
            **enc,
        )
    )
    if axis == "y":
        text = text.encode(x=alt.value(0))
    else:
        # The two vertical lines are close together: their labels go on two rows.
        text = text.encode(y=alt.Y("row:Q", scale=None)).mark_text(
            align="left", baseline="top", dx=4, fontWeight="bold"
        )
    return [rule, text]


def prompt_histogram(df: pd.DataFrame, warn: int | None, critical: int | None) -> AnyChart:
    """How many requests fell in each prompt-size bin (log scale: bins are 9% wide), with the
    lines as vertical rules. Columns: ``bin_low``, ``bin_high``, ``requests``."""
    bars = (
        alt.Chart(df)
        .mark_bar(color="#1f77b4")
        .encode(
            x=alt.X(
                "bin_low:Q",
                title="prompt tokens (log scale)",
                scale=alt.Scale(type="log"),
                axis=alt.Axis(format="~s"),
            ),
            x2="bin_high:Q",
            y2=alt.datum(0),  # bars stand on zero (x2 alone would draw thin ranged ticks)
            y=alt.Y(
                "requests:Q",
                title="requests",
                scale=alt.Scale(zero=True),
                axis=alt.Axis(tickMinStep=1, format="d"),
            ),
            tooltip=[
                alt.Tooltip("bin_low:Q", title="from", format=","),
                alt.Tooltip("bin_high:Q", title="to", format=","),
                alt.Tooltip("requests:Q", format=","),
            ],
        )
    )
    layers: list[alt.Chart] = [bars]
    if warn is not None and critical is not None:
        layers.extend(_threshold_rules(_lines(warn, critical, short=True), "x"))
    return alt.layer(*layers).resolve_scale(color="independent").properties(height=280)


def pool_occupancy(
    df: pd.DataFrame,
    window: Window | None = None,
    bucket_s: float | None = None,
    markers: pd.DataFrame | None = None,
) -> AnyChart:
    """Tokens in use per node over time (bucket max as a step as wide as its bucket, the mean
    in the tooltip), each node's capacity as a dashed line across the whole chart, and
    incident markers (:func:`markers_frame`): the stale reads where the pool ran full.
    Columns: ``time``, ``node``, ``used_max``, ``used_avg``, ``capacity``."""
    x = _time_x(window)
    color = alt.Color("node:N", title="node (role)", legend=alt.Legend(orient="bottom"))
    y = alt.Y("used_max:Q", title="KV tokens in use", axis=alt.Axis(format="~s"))
    steps = (
        alt.Chart(_steps(df, ["node"], bucket_s))
        .mark_line(interpolate="step-after")
        .encode(x=x, y=y, color=color, detail="segment:N")
    )
    used = _bucket_points(
        df,
        x,
        y,
        alt.Color("node:N", legend=None),  # the steps' legend says it
        [
            "node:N",
            alt.Tooltip("used_max:Q", title="used (max)", format=","),
            alt.Tooltip("used_avg:Q", title="used (mean)", format=",.0f"),
            alt.Tooltip("capacity:Q", format=","),
            alt.Tooltip("occupancy:Q", format=".0%"),
        ],
    )
    capacity = (
        alt.Chart(_across(df[["time", "node", "capacity"]], ["node"], window))
        .mark_line(strokeDash=[6, 4], opacity=0.7, interpolate="step-after")
        .encode(
            x=x,
            y="capacity:Q",
            color=alt.Color("node:N", legend=None),
            tooltip=["node:N", alt.Tooltip("capacity:Q", format=",")],
        )
    )
    layers = [capacity, steps, used, *_marker_layers(markers, x)]
    return alt.layer(*layers).resolve_scale(color="independent").properties(height=260)


def page_events(
    df: pd.DataFrame, window: Window | None = None, markers: pd.DataFrame | None = None
) -> AnyChart:
    """Page events per time bucket, stacked by kind (stale reads in red), each bar as wide as
    its bucket, with incident markers (:func:`markers_frame`).
    Columns: ``time``, ``end``, ``kind``, ``events``, ``pages``, ``cross_tenant``."""
    x = _time_x(window)
    bars = (
        alt.Chart(_with_when(df))
        .mark_bar()
        .encode(
            x=x,
            x2="end:T",
            y=alt.Y("events:Q", title="events", stack=True),
            color=alt.Color(
                "kind:N",
                title=None,
                scale=alt.Scale(domain=list(KINDS), range=list(KINDS.values())),
                legend=alt.Legend(orient="bottom"),
            ),
            tooltip=[
                alt.Tooltip("when:N", title="bucket"),
                "deployment_id:N",
                "kind:N",
                alt.Tooltip("events:Q", format=","),
                alt.Tooltip("pages:Q", format=","),
                alt.Tooltip("cross_tenant:Q", title="cross-tenant", format=","),
            ],
        )
    )
    layers = [bars, *_marker_layers(markers, x)]
    return alt.layer(*layers).resolve_scale(color="independent").properties(height=220)


SEVERITY_COLORS = {"critical": CRIT, "warning": WARN, "info": "#1f77b4"}


def alert_timeline(
    df: pd.DataFrame, window: Window | None = None, markers: pd.DataFrame | None = None
) -> AnyChart:
    """Each alert as a bar from when it became active to when it resolved (or now), one row
    per rule and deployment, coloured by severity, with incident markers: what was firing
    when the incident opened.
    Columns: ``time`` (start), ``end``, ``row``, ``severity``, ``id``, ``state``."""
    x = _time_x(window)
    bars = (
        alt.Chart(_with_when(df))
        .mark_bar(height=10, cornerRadius=2)
        .encode(
            x=x,
            x2="end:T",
            y=alt.Y("row:N", title=None, sort=None, axis=alt.Axis(labelLimit=320)),
            color=alt.Color(
                "severity:N",
                title=None,
                scale=alt.Scale(domain=list(SEVERITY_COLORS), range=list(SEVERITY_COLORS.values())),
                legend=alt.Legend(orient="bottom"),
            ),
            tooltip=[
                "id:Q",
                "row:N",
                "severity:N",
                "state:N",
                alt.Tooltip("when:N", title="since"),
            ],
        )
    )
    layers = [bars, *_marker_layers(markers, x)]
    # a band per row (a fixed pixel height would squeeze many rows into one)
    return alt.layer(*layers).resolve_scale(color="independent").properties(height=alt.Step(22))


def verification_history(df: pd.DataFrame) -> AnyChart:
    """Verified safe context per deployment and model over time; failed runs as crosses.
    Columns: ``time``, ``target``, ``safe_context``, ``result``."""
    return (
        alt.Chart(_with_when(df))
        .mark_point(size=90, filled=True)
        .encode(
            x=_time_x(None, "verified at (UTC)"),
            y=alt.Y("safe_context:Q", title="verified safe context", axis=alt.Axis(format="~s")),
            color=alt.Color("target:N", title="deployment · model"),
            shape=alt.Shape(
                "result:N",
                title=None,
                scale=alt.Scale(domain=["passed", "failed"], range=["circle", "cross"]),
            ),
            tooltip=[
                alt.Tooltip("when:N", title="verified at"),
                "target:N",
                "result:N",
                alt.Tooltip("safe_context:Q", format=","),
            ],
        )
        .properties(height=240)
    )


def review_ratios(df: pd.DataFrame) -> AnyChart:
    """The quarterly review at a glance: each route's largest prompt as a share of its safe
    context, with the 80% and 100% lines. Columns: ``target``, ``max_ratio``."""
    bars = (
        alt.Chart(df)
        .mark_bar()
        .encode(
            y=alt.Y("target:N", title=None, sort="-x", axis=alt.Axis(labelLimit=420)),
            x=alt.X(
                "max_ratio:Q", title="largest prompt / safe context", axis=alt.Axis(format="%")
            ),
            color=alt.when(alt.datum.max_ratio >= 1.0)
            .then(alt.value(CRIT))
            .when(alt.datum.max_ratio >= 0.8)
            .then(alt.value(WARN))
            .otherwise(alt.value("#1f77b4")),
            tooltip=["target:N", alt.Tooltip("max_ratio:Q", format=".1%")],
        )
    )
    rules = (
        alt.Chart(pd.DataFrame({"ratio": [0.8, 1.0], "line": ["80%", "100%"]}))
        .mark_rule(strokeDash=[6, 4], strokeWidth=2)
        .encode(
            x="ratio:Q",
            color=alt.Color("line:N", scale=alt.Scale(domain=["80%", "100%"], range=[WARN, CRIT])),
        )
    )
    return alt.layer(bars, rules).properties(height=alt.Step(22))
