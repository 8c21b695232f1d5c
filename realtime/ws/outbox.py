"""A session's send queue: every event and audio frame goes through it in order, so an ack is never overtaken by
audio queued before it, and a cancel can drop a context's unsent audio before its ack is queued."""
from __future__ import annotations

import asyncio
import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Outgoing:
    """What the sender writes in one go: an event, or a chunk of audio as its frames' messages (a 20 ms Opus packet
    is a message, so a chunk is many: one item for them all keeps the loop's work per packet small)."""
    messages: list[str | bytes]
    context_id: str | None = None
    message_ms: list[float] | None = None  # an audio item: the audio each message carries
    on_sent: Callable[[], None] | None = None  # e.g. record time to first audio when the frame really leaves
    closes: bool = False  # the sender stops here (a field, not a context id: any string is a client's context id)
    audio_ms: float = field(init=False)  # the audio it carries

    def __post_init__(self) -> None:
        self.audio_ms = sum(self.message_ms) if self.message_ms else 0.0

    def split_first(self) -> tuple[Outgoing, Outgoing | None]:
        """The first message as an item of its own (with `on_sent`), and the rest (None if there is none)."""
        if len(self.messages) <= 1:
            return self, None
        ms = self.message_ms or [0.0] * len(self.messages)
        return (Outgoing(self.messages[:1], self.context_id, ms[:1], self.on_sent),
                Outgoing(self.messages[1:], self.context_id, ms[1:]))


class Outbox:
    def __init__(self) -> None:
        self._items: deque[Outgoing] = deque()
        self._urgent = 0  # the first items are urgent ones, in the order they were put (pongs answer in order)
        self._ready = asyncio.Event()
        self._taken = asyncio.Event()  # set whenever items leave
        self.queued_ms = 0.0  # audio waiting to be sent

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: Outgoing, urgent: bool = False) -> None:
        """`urgent`: ahead of everything queued but the urgent items before it."""
        if urgent:
            self._items.insert(self._urgent, item)
            self._urgent += 1
        else:
            self._items.append(item)
        self.queued_ms += item.audio_ms
        self._ready.set()

    def put_back(self, item: Outgoing) -> None:
        """Send this item next, behind the urgent ones only: the rest of an item the sender took but sends a message
        at a time (the socket is paused), where a cancel can still drop it."""
        self._items.insert(self._urgent, item)
        self.queued_ms += item.audio_ms
        self._ready.set()

    def put_event(self, message: dict[str, Any], context_id: str | None = None, urgent: bool = False) -> None:
        """A server event (protocol.event), serialised here once; `context_id` lets a cancel drop it."""
        self.put(Outgoing([json.dumps(message)], context_id), urgent=urgent)

    def drop(self, context_id: str) -> float:
        """Forget a context's unsent items (its audio after a cancel); returns the audio dropped, in ms."""
        self._urgent = sum(item.context_id != context_id for item in list(self._items)[:self._urgent])
        kept = deque(item for item in self._items if item.context_id != context_id)
        dropped = self.queued_ms - sum(item.audio_ms for item in kept)
        self.queued_ms -= dropped
        self._items = kept
        self._settle()
        return dropped

    def take_until_close(self) -> list[Outgoing]:
        """The items queued ahead of the first closing item, taken out (a sender that gives up sends them another
        way)."""
        taken = []
        while self._items and not self._items[0].closes:
            taken.append(self._pop())
        return taken

    def move_to_front(self, item: Outgoing) -> bool:
        """Send this very item next if it is still queued (a warning that explains the error put before it)."""
        for index, queued in enumerate(self._items):
            if queued is item:
                del self._items[index]
                self._items.appendleft(item)
                self._urgent += index >= self._urgent  # it joins the urgent ones, first
                return True
        return False

    async def get(self) -> Outgoing:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._pop()

    def _pop(self) -> Outgoing:
        item = self._items.popleft()
        self._urgent = max(0, self._urgent - 1)
        self.queued_ms -= item.audio_ms
        self._settle()
        return item

    def _settle(self) -> None:
        self._taken.set()
        if not self._items:
            self.queued_ms = 0.0

    async def below(self, audio_ms: float) -> None:
        """Wait until less than `audio_ms` of audio is queued."""
        while self.queued_ms >= audio_ms:
            self._taken.clear()
            await self._taken.wait()
