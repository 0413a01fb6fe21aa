"""PDFs read back as a person sees them: every page rendered to an image, none blank."""

from __future__ import annotations

import pypdfium2


def assert_renders(pdf: bytes, min_pages: int = 1) -> int:
    """Render every page (PDFium, as a viewer would); each must show ink. Returns the page
    count."""
    doc = pypdfium2.PdfDocument(pdf)
    try:
        assert len(doc) >= min_pages
        for i, page in enumerate(doc, 1):
            img = page.render(scale=0.4).to_pil().convert("L")
            assert sum(img.histogram()[:200]) > 200, f"page {i} renders blank"
        return len(doc)
    finally:
        doc.close()
