"""Reports offered as downloads: one response shape for every report's CSV and PDF."""

from __future__ import annotations

from typing import Literal

from fastapi.responses import Response

_MEDIA = {"csv": "text/csv; charset=utf-8", "pdf": "application/pdf"}


def attachment(body: bytes | str, name: str, format: Literal["csv", "pdf"]) -> Response:
    """``body`` as the download ``{name}.{format}``."""
    return Response(
        body,
        media_type=_MEDIA[format],
        headers={"Content-Disposition": f'attachment; filename="{name}.{format}"'},
    )
