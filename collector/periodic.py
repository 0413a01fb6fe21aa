"""A background pass every N seconds in a thread: the policy timer and the rollup refresher.

A pass that fails is logged and the next one runs as usual: a database outage
(:class:`CollectorError`) skips passes until it is over, a bug is logged with its traceback.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from collector.errors import CollectorError

log = logging.getLogger("kvwatch.periodic")


class Periodic:
    def __init__(
        self,
        name: str,
        interval_s: float,
        run: Callable[[], object],
        *,
        at_start: Callable[[], object] | None = None,
    ):
        self.name = name
        self.interval_s = interval_s
        self.at_start = at_start  # a first pass as soon as the thread starts
        self._run = run
        self.passes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name=f"kvwatch-{self.name}", daemon=True
            )
            self._thread.start()

    def _loop(self) -> None:
        if self.at_start is not None:
            self.run_once(self.at_start)
        while not self._stop.wait(self.interval_s):
            self.run_once()

    def run_once(self, run: Callable[[], object] | None = None) -> None:
        try:
            (run or self._run)()
            self.passes += 1
        except CollectorError as exc:  # the database is down: the next pass catches up
            log.warning("%s pass skipped: %s", self.name, exc.message)
        except Exception:
            log.exception("%s pass failed", self.name)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
