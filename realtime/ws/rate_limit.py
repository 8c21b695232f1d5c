"""The per-socket message rate (a token bucket), so one client cannot flood the event loop; the voxgate.v1 and
chat sockets both use it."""
from __future__ import annotations

import time


class RateLimiter:
    """A token bucket: `rate` messages per second, bursts of twice that."""

    def __init__(self, rate: float) -> None:
        self.rate, self.capacity = rate, 2 * rate
        self.tokens, self.at = self.capacity, time.monotonic()

    def allow(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True
