"""One rate-limited warning line for refused requests, shared by the gRPC and HTTP fronts: a flood of hostile
requests costs the log one line per interval, not a traceback each."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class RateLimitedWarning:
    """At most one warning line per `interval` seconds; the next line says how many were held back meanwhile."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.interval = interval
        self.clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None
        self._held_back = 0

    def warn(self, message: str) -> bool:
        """Logs `message` unless a line went out less than `interval` ago; returns whether it logged."""
        with self._lock:
            now = self.clock()
            if self._last is not None and now - self._last < self.interval:
                self._held_back += 1
                return False
            held, self._held_back, self._last = self._held_back, 0, now
        more = f" (and {held} more in the last {self.interval:g} s)" if held else ""
        self.logger.warning("%s%s", message, more)
        return True
