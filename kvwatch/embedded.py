"""Serve an ASGI app on 127.0.0.1 in a background thread (the demo's embedded collector;
the tests use it too)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collector.settings import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve_in_thread(app: Any, *, port: int | None = None, timeout_s: float = 30) -> Iterator[str]:
    """Yield the base URL once uvicorn is accepting connections; stop it on exit."""
    import uvicorn

    port = port or free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=server.run, name=f"kvwatch-http-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the server on 127.0.0.1:{port} did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def collector_app(settings: Settings | None = None) -> Any:
    """The collector as ``kvwatch serve`` runs it: scheduled verifications run with
    kvwatch's verifier, scheduled scrapes with kvwatch's scraper. Without ``settings``, built
    from the environment: the factory each of its worker processes calls."""
    from collector.app import create_app
    from kvwatch.scheduled_scrape import scrape_target
    from kvwatch.verify.scheduled import run_scheduled

    return create_app(settings, verifier=run_scheduled, scraper=scrape_target, freeze_heap=True)
