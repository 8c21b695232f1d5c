"""The per-socket message rate and byte rate (token buckets), so one client cannot flood the event loop; the
voxgate.v1 and chat sockets both use them."""
from __future__ import annotations

import time

from realtime.ws.protocol import ProtocolError, dropped


class RateLimiter:
    """A token bucket: `rate` tokens (messages, or bytes) per second, bursts of twice that."""

    def __init__(self, rate: float) -> None:
        self.rate, self.capacity = rate, 2 * rate
        self.tokens, self.at = self.capacity, time.monotonic()

    def allow(self, cost: float = 1) -> bool:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < cost:
            return False
        self.tokens -= cost
        return True


class MessageBudget:
    """A socket's budget: `message_rate` messages a second, and text at twice `max_message_bytes` a second (each
    bucket bursts to twice its rate). The text's bucket bounds the parsing: 256 KB of small JSON values cost ~12 ms
    of the event loop, and the message rate alone let one socket spend seconds a second on it."""

    def __init__(self, message_rate: float, max_message_bytes: int) -> None:
        self.messages = RateLimiter(message_rate)
        self.text = RateLimiter(2 * max_message_bytes)

    def refusal(self, text: str) -> ProtocolError | None:
        """The `rate_limited` error of a message past the budget (it is dropped unparsed), or None."""
        return self._refusal(text, len(text))

    def frame_refusal(self, frame: bytes) -> ProtocolError | None:
        """The same for a binary frame from the client: a message of its size, with no text to name it by."""
        return self._refusal("", len(frame))

    def _refusal(self, text: str, size: int) -> ProtocolError | None:
        if not self.messages.allow():
            return dropped(text, f"more than {self.messages.rate:g} messages per second")
        if not self.text.allow(size):
            return dropped(text, f"more than {self.text.rate / 1024:g} KiB of messages per second")
        return None
