"""The policy timer: runs :meth:`AlertingService.tick` every ``policy_timer_s`` in a thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime

from collector.alerting.service import AlertingService
from collector.errors import CollectorError

log = logging.getLogger("kvwatch.alerting")


class PolicyTimer:
    def __init__(
        self,
        service: AlertingService,
        interval_s: float,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ):
        self.service = service
        self.interval_s = interval_s
        self.clock = clock
        self.passes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvwatch-policy", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.run_once()

    def run_once(self) -> None:
        try:
            self.service.tick(self.clock())
            self.passes += 1
        except CollectorError as exc:  # the database is down: the next pass catches up
            log.warning("policy timer pass skipped: %s", exc.message)
        except Exception:
            log.exception("policy timer pass failed")

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
