"""Reports offered as downloads: one response shape for every report's CSV and PDF."""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO, Literal

from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from collector import text

_MEDIA = {"csv": "text/csv; charset=utf-8", "pdf": "application/pdf"}


def attachment(body: bytes | str, name: str, format: Literal["csv", "pdf"]) -> Response:
    """``body`` as the download ``{name}.{format}``."""
    return Response(
        text.encode(body) if isinstance(body, str) else body,
        media_type=_MEDIA[format],
        headers={"Content-Disposition": f'attachment; filename="{name}.{format}"'},
    )


def attachment_file(body: BinaryIO, name: str, format: Literal["csv", "pdf"]) -> Response:
    """An open file as the download ``{name}.{format}``, streamed in blocks and closed once
    sent (a report's CSV can be far larger than memory)."""

    def blocks() -> Iterator[bytes]:
        while block := body.read(1 << 20):
            yield block

    return StreamingResponse(
        blocks(),
        media_type=_MEDIA[format],
        headers={"Content-Disposition": f'attachment; filename="{name}.{format}"'},
        background=BackgroundTask(body.close),
    )
