"""PDFs read back as a person sees them: every page rendered to an image, none blank, and no
character set outside the page's margins (a long name that ran off the edge)."""

from __future__ import annotations

import pypdfium2

# fpdf2's default margin is 1 cm; half a point of slack for glyph side bearings
MARGIN_PT = 72 / 2.54
SLACK_PT = 0.5


def assert_renders(pdf: bytes, min_pages: int = 1) -> int:
    """Render every page (PDFium, as a viewer would); each must show ink, and every
    character must lie within the left and right margins. Returns the page count."""
    doc = pypdfium2.PdfDocument(pdf)
    try:
        assert len(doc) >= min_pages
        for i, page in enumerate(doc, 1):
            img = page.render(scale=0.4).to_pil().convert("L")
            assert sum(img.histogram()[:200]) > 200, f"page {i} renders blank"
            _within_margins(page, i)
        return len(doc)
    finally:
        doc.close()


def _within_margins(page: pypdfium2.PdfPage, number: int) -> None:
    width = page.get_width()
    text = page.get_textpage()
    try:
        for c in range(text.count_chars()):
            left, _, right, _ = text.get_charbox(c)
            if right <= left:  # spaces and line breaks have no ink
                continue
            assert left >= MARGIN_PT - SLACK_PT and right <= width - MARGIN_PT + SLACK_PT, (
                f"page {number}: {text.get_text_range(max(0, c - 20), 40)!r} runs past a margin"
            )
    finally:
        text.close()
