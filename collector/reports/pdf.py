"""What the report PDFs share: the A4 document with DejaVu fonts, headings, key/value rows,
tables, and a footer naming the report and the page on every page (fpdf2; charts are
matplotlib with the Agg backend, PNG in memory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

from fpdf import FPDF

FONT_DIR = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
_CELL_MAX = 160  # characters: a table row must fit on one page (page-id lists can be long)


class ReportPdf(FPDF):
    """``label`` names the kind of report in the title and every footer
    (``kvwatch <label> <report_id>``, ``page N of M``)."""

    def __init__(self, report_id: str, label: str):
        super().__init__(format="A4")
        self.report_id = report_id
        self.label = label
        self.add_font("DejaVu", "", str(FONT_DIR / "DejaVuSans.ttf"))
        self.add_font("DejaVu", "B", str(FONT_DIR / "DejaVuSans-Bold.ttf"))
        self.add_font("DejaVuMono", "", str(FONT_DIR / "DejaVuSansMono.ttf"))
        self.set_auto_page_break(auto=True, margin=18)
        self.set_title(f"{label[:1].upper()}{label[1:]} {report_id}")
        self.set_creator("kvwatch")

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
        self.cell(0, 9, text, new_x="LMARGIN", new_y="NEXT")
        self.set_font("DejaVu", "", 9)

    def para(self, text: str, size: int = 9) -> None:
        self.set_font("DejaVu", "", size)
        self.multi_cell(0, 5, text, new_x="LMARGIN", new_y="NEXT")

    def kv(self, rows: list[tuple[str, Any]]) -> None:
        for k, v in rows:
            self.set_font("DejaVu", "B", 9)
            self.cell(55, 6, k)
            self.set_font("DejaVu", "", 9)
            self.multi_cell(0, 6, "-" if v is None else str(v), new_x="LMARGIN", new_y="NEXT")

    def grid(self, headings: list[str], rows: list[list[Any]], widths: list[int]) -> None:
        self.set_font("DejaVu", "", 7)
        with self.table(col_widths=widths, text_align="LEFT", line_height=4.5) as t:
            head = t.row()
            for h in headings:
                head.cell(h)
            for r in rows:
                row = t.row()
                for v in r:
                    row.cell(cell_text(v))
        self.ln(2)
        self.set_font("DejaVu", "", 9)


def short_time(at: str | None) -> str:
    """``2026-12-02 06:56:46.704`` (UTC, milliseconds): fits a table column unbroken."""
    return "-" if not at else at.replace("T", " ").rstrip("Z")[:23]


def cell_text(v: Any) -> str:
    text = "-" if v is None or v == "" else str(v)
    return text if len(text) <= _CELL_MAX else text[: _CELL_MAX - 1] + "…"
