"""The slow-consumer policy (PROTOCOL.md): a client that reads its audio slower than it is made gets one warning and
its synthesis pauses: once the session's send queue is full its contexts stop encoding, and once a context has
PAUSE_AFTER_MS of audio waiting behind that (or a send queue's worth, if less) its engine request pauses, keeping its
slot, until half of it has gone out. A client that reads nothing for as long as the hard limit's audio would play (4
send queues), a pause that lasts that long (a client that takes a chunk now and then), or a context whose waiting
audio passes the hard limit behind a full send queue all the same, ends the session with a fatal error."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from realtime.ws.outbox import Outbox, Outgoing
from realtime.ws.protocol import ProtocolError, event

HARD_LIMIT_FACTOR = 4  # unsent audio past this many send queues ends the session
# Items (events and frames) waiting to be sent past which the client is not reading: a client that floods messages
# and reads nothing made an error or pong per message, held without bound (500 MB for 2M messages). Audio alone stays
# far below it: the hard limit holds 20 s of 10 ms frames per context.
MAX_QUEUED_ITEMS = 10_000
PAUSE_AFTER_MS = 1000  # audio made but not yet encoded (the send queue is full) past which a context's synthesis pauses


class SlowConsumerPolicy:
    def __init__(self, outbox: Outbox, send_queue_ms: float, abort: Callable[[ProtocolError], None]) -> None:
        """`abort` ends the session with a fatal error (the session's close code for policy violations)."""
        self.outbox, self.send_queue_ms, self.abort = outbox, send_queue_ms, abort
        self.hard_limit_ms = HARD_LIMIT_FACTOR * send_queue_ms
        self.pause_ms = min(PAUSE_AFTER_MS, send_queue_ms)
        self._warning: Outgoing | None = None  # sent once per session

    async def wait_for_room(self) -> None:
        """Before a context encodes more audio: while the outbox holds a send queue of audio, warn and wait; a
        client that takes nothing for the hard limit's time is not reading at all."""
        if self.outbox.queued_ms >= self.send_queue_ms:
            self._warn()
            try:
                async with asyncio.timeout(self.hard_limit_ms / 1000):
                    await self.outbox.below(self.send_queue_ms)
            except TimeoutError:
                seconds = self.hard_limit_ms / 1000
                self.abort(ProtocolError("slow_consumer", f"the client has read no audio for {seconds:g} s; closing",
                                         fatal=True))
                await self.outbox.below(self.send_queue_ms)  # the abort cancels the context (Session.abort)

    def should_pause(self, waiting_ms: float) -> bool:
        """The send queue is full and a context's audio waiting behind it has reached `pause_ms`: its synthesis
        pauses (a slow encoder alone never pauses it)."""
        return waiting_ms >= self.pause_ms and self.outbox.queued_ms >= self.send_queue_ms

    def may_resume(self, waiting_ms: float) -> bool:
        """Half of it has gone out since: synthesis resumes (a margin, so that it does not flip every chunk)."""
        return waiting_ms < self.pause_ms / 2

    def paused_too_long(self) -> None:
        """A context's synthesis stayed paused for the hard limit's time: the client takes too little to play."""
        self._warn()
        self.abort(ProtocolError("slow_consumer", f"the client took too little audio for {self.hard_limit_ms / 1000:g}"
                                                  " s; closing", fatal=True))

    def check_backlog(self, waiting_ms: float) -> None:
        """A context's synthesized audio not yet encoded: past the hard limit, behind a full send queue, the client
        does not read at all. Behind a send queue with room the backlog is the server's own (its audio encoders fell
        behind): no fault of the client's (a hostile try: an encoder stalled for 8 s ended reading sessions)."""
        if waiting_ms > self.hard_limit_ms and self.outbox.queued_ms >= self.send_queue_ms:
            self._warn()
            self.abort(ProtocolError("slow_consumer", "the client does not read its audio; closing", fatal=True))

    def check_outbox(self, items: int) -> None:
        """After each client message: an outbox past MAX_QUEUED_ITEMS means the client sends and does not read."""
        if items > MAX_QUEUED_ITEMS:
            self.abort(ProtocolError("slow_consumer", f"more than {MAX_QUEUED_ITEMS} messages wait to be sent: the "
                                                      "client does not read them; closing", fatal=True))

    def warning_first(self) -> None:
        """A fatal error is about to go out ahead of queued audio: a warning still queued goes before it, as it
        explains the error."""
        if self._warning is not None:
            self.outbox.move_to_front(self._warning)

    def _warn(self) -> None:
        if self._warning is None:
            self._warning = Outgoing([json.dumps(event(
                "warning", code="slow_consumer", message="the client reads audio slower than it is made; synthesis "
                "pauses until it catches up"))])
            self.outbox.put(self._warning, urgent=True)
