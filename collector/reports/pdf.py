"""What the report PDFs share: the A4 document with DejaVu fonts, headings, key/value rows,
tables, and a footer naming the report and the page on every page (fpdf2; charts are
matplotlib with the Agg backend, PNG in memory)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

from fpdf import FPDF, FontFace

from collector import text as text_rules

FONT_DIR = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
_CELL_MAX = 160  # characters: a table row must fit on one page (page-id lists can be long)
GRID_PT, GRID_MIN_PT = 7, 5  # a table's type size, and the smallest a long word is set in
CELL_PAD = 1.0  # mm, each side of a table cell


class ReportPdf(FPDF):
    """``label`` names the kind of report in the title and every footer
    (``kvwatch <label> <report_id>``, ``page N of M``)."""

    def __init__(self, report_id: str, label: str, created_at: datetime | None = None):
        super().__init__(format="A4")
        self.report_id = report_id
        self.label = label
        self.add_font("DejaVu", "", str(FONT_DIR / "DejaVuSans.ttf"))
        self.add_font("DejaVu", "B", str(FONT_DIR / "DejaVuSans-Bold.ttf"))
        self.add_font("DejaVuMono", "", str(FONT_DIR / "DejaVuSansMono.ttf"))
        self.set_auto_page_break(auto=True, margin=18)
        self.set_title(f"{label[:1].upper()}{label[1:]} {report_id}")
        self.set_creator("kvwatch")
        if created_at is not None:
            # The document's own time, not the rendering's: the same report renders to the
            # same bytes wherever and whenever (the API's and the CLI's PDF hash alike, so
            # one signature covers both).
            self.set_creation_date(created_at)

    def normalize_text(self, text: str) -> str:
        # a lone surrogate an older version stored has no glyph and no UTF-8: U+FFFD, as
        # the API shows it (collector.text), never a font warning carrying the raw text
        return super().normalize_text(text_rules.scrub(text))

    def footer(self) -> None:
        self.set_y(-12)
        self.set_font("DejaVu", "", 8)
        self.set_text_color(90, 90, 90)
        self.cell(0, 6, f"kvwatch {self.label} {self.report_id}", align="L")
        self.set_x(self.l_margin)
        self.cell(0, 6, f"page {self.page_no()} of {{nb}}", align="R")
        self.set_text_color(0, 0, 0)

    def h1(self, text: str) -> None:
        self.set_font("DejaVu", "B", 14)
        # a heading may hold a tenant's or model's name (up to 256 characters): it wraps
        self.multi_cell(0, 8, text, new_x="LMARGIN", new_y="NEXT", align="L")
        self.set_font("DejaVu", "", 9)

    def para(self, text: str, size: int = 9) -> None:
        self.set_font("DejaVu", "", size)
        # ragged right: justified lines holding long timestamps and ids open wide gaps
        self.multi_cell(0, 5, text, new_x="LMARGIN", new_y="NEXT", align="L")

    def kv(
        self, rows: list[tuple[str, Any]], mono: frozenset[str] | set[str] = frozenset()
    ) -> None:
        """Label and value rows; the label column as wide as the longest label (a label never
        runs into its value). Values of the labels in ``mono`` (hashes) are set monospaced."""
        self.set_font("DejaVu", "B", 9)
        width = min(max((self.get_string_width(k) for k, _ in rows), default=0) + 4, 90)
        width = max(width, 45)
        for k, v in rows:
            self.set_font("DejaVu", "B", 9)
            self.multi_cell(width, 6, k, new_x="RIGHT", new_y="TOP")
            if k in mono:
                self.set_font("DejaVuMono", "", 8)
            else:
                self.set_font("DejaVu", "", 9)
            # ragged right: a justified value holding a long path opens wide gaps
            self.multi_cell(0, 6, figure(v), new_x="LMARGIN", new_y="NEXT", align="L")
        self.set_font("DejaVu", "", 9)

    def grid(self, headings: list[str], rows: list[list[Any]], widths: list[int]) -> None:
        """A table wrapped at word boundaries: a cell holding a word wider than its column
        (a long tenant name, an id) is set in a smaller type instead of being broken
        mid-word."""
        self.set_font("DejaVu", "", GRID_PT)
        cells = [[cell_text(v) for v in r] for r in [headings, *rows]]
        final = self._column_widths(cells, widths)
        room = [w - 2 * CELL_PAD for w in final]
        with self.table(
            col_widths=final,
            text_align="LEFT",
            line_height=4.5,
            padding=CELL_PAD,
        ) as t:
            for r in cells:
                row = t.row()
                for text, fits in zip(r, room, strict=True):
                    size = self._fitting_size(text, fits)
                    row.cell(text, style=None if size == GRID_PT else FontFace(size_pt=size))
        self.ln(2)
        self.set_font("DejaVu", "", 9)

    def _column_widths(self, cells: list[list[str]], widths: list[int]) -> list[float]:
        """The given proportions, each column widened to hold its longest word (taken from
        columns with room to spare): at the table's type size if the page allows, else at
        the smallest; what still does not fit is set smaller cell by cell."""
        prop = [w * self.epw / sum(widths) for w in widths]
        for size in (GRID_PT, GRID_MIN_PT):
            self.set_font_size(size)
            need = [
                max(self.get_string_width(_longest(r[i])) for r in cells) + 2 * CELL_PAD + 0.5
                for i in range(len(widths))
            ]
            final = [max(p, n) for p, n in zip(prop, need, strict=True)]
            excess = sum(final) - self.epw
            slack = [f - n for f, n in zip(final, need, strict=True)]
            if excess <= sum(slack):
                self.set_font_size(GRID_PT)
                if excess <= 0:
                    return final
                total = sum(slack)
                return [f - sl * excess / total for f, sl in zip(final, slack, strict=True)]
        self.set_font_size(GRID_PT)
        return prop

    def _fitting_size(self, text: str, width: float) -> float:
        """The largest type size (down to ``GRID_MIN_PT``) at which the longest word fits."""
        longest = _longest(text)
        size = float(GRID_PT)
        while size > GRID_MIN_PT:
            self.set_font_size(size)
            if self.get_string_width(longest) <= width:
                break
            size -= 0.5
        self.set_font_size(GRID_PT)
        return size

    def notes(self, items: list[tuple[str, str]]) -> None:
        """Footnotes: what each figure above means, one line each."""
        self.set_font("DejaVu", "", 7.5)
        for term, meaning in items:
            self.set_font("DejaVu", "B", 7.5)
            self.write(4, f"{term}: ")
            self.set_font("DejaVu", "", 7.5)
            self.write(4, meaning)
            self.ln(4)
        self.set_font("DejaVu", "", 9)


def _longest(text: str) -> str:
    return max(text.split(), key=len, default="")


def short_time(at: str | None) -> str:
    """``2026-12-02 06:56:46.704`` (UTC, milliseconds): fits a table column unbroken."""
    return "-" if not at else at.replace("T", " ").rstrip("Z")[:23]


def figure(v: Any) -> str:
    """A value as printed: ``-`` for nothing, counts with thousands separators (``11,862``
    tokens reads at a glance where ``11862`` does not)."""
    if v is None or v == "":
        return "-"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def cell_text(v: Any) -> str:
    text = figure(v)
    return text if len(text) <= _CELL_MAX else text[: _CELL_MAX - 1] + "…"
