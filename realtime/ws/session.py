"""One voxgate.v1 WebSocket session: reads client messages, runs its contexts, and sends everything through one
ordered outbox (PROTOCOL.md is the contract; docs/protocol.md says where it is silent)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from engine.errors import RequestError
from realtime.audio import StreamEncoder
from realtime.gateway import Gateway
from realtime.voices import VoiceError
from realtime.ws.contexts import ContextStream
from realtime.ws.outbox import Outbox, Outgoing
from realtime.ws.protocol import (
    CLOSE_GOING_AWAY,
    CLOSE_IDLE,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    PROTOCOL,
    ProtocolError,
    SessionConfig,
    audio_description,
    configure,
    error_event,
    event,
    parse_message,
)

log = logging.getLogger("voxgate")
SHUTDOWN_GRACE_S = 5.0
ABORT_GRACE_S = 2.0
MAX_CLOSED_IDS = 10000


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


class Session:
    def __init__(self, websocket: WebSocket, gateway: Gateway, config: SessionConfig) -> None:
        self.ws, self.gateway, self.config = websocket, gateway, config
        self.limits = gateway.limits
        self.id = uuid.uuid4().hex
        self.outbox = Outbox()
        self.contexts: dict[str, ContextStream] = {}  # open
        self.finished: dict[str, float] = {}  # closed context id -> audio sent (ms)
        self.text_started = False
        self.closing = False
        self.closed = False  # the socket is gone
        self._stream_ids = 0
        self._slow_warning: Outgoing | None = None  # sent once per session
        self._aborted = False
        self._limiter = RateLimiter(self.limits.max_message_rate)
        self._last_activity = time.monotonic()
        self._close: tuple[int, str] | None = None
        self._sender_task: asyncio.Task | None = None
        self._ended = asyncio.Event()  # set once the socket is closed

    # --- life cycle ----------------------------------------------------------------------------------------------

    async def run(self, config_errors: list[ProtocolError]) -> None:
        """Serve the socket until either side ends it; the session counts as open exactly that long."""
        self.gateway.sessions.add(self)
        self._send_started()
        for failure in config_errors:
            self._error(failure)
        sender = self._sender_task = asyncio.create_task(self._sender())
        watchdog = asyncio.create_task(self._idle_watchdog())
        reader = asyncio.create_task(self._reader())
        try:
            await asyncio.wait([sender, reader], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for context in list(self.contexts.values()):
                context.cancel()
            self.gateway.metrics.contexts_active.dec(len(self.contexts))
            self.contexts.clear()
            for task in (sender, watchdog, reader):
                task.cancel()
            self.closed = True
            self.gateway.sessions.discard(self)
            if self._close is not None:
                code, reason = self._close
                try:  # as long as the peer takes to read what is queued before it (the session is no longer counted)
                    await self.ws.close(code, reason)
                except (RuntimeError, WebSocketDisconnect, OSError):
                    pass
            self._ended.set()

    async def _reader(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            self._last_activity = time.monotonic()
            if message.get("bytes") is not None:
                self._error(ProtocolError("invalid_message", "binary frames carry audio only; send JSON text frames"))
            elif message.get("text") is not None:
                self._handle_text(message["text"])

    async def _sender(self) -> None:
        """Sends the outbox in order; a fatal error or a close item ends the session after it is sent."""
        try:
            while True:
                item = await self.outbox.get()
                if item.context_id == _CLOSE:
                    return
                if isinstance(item.payload, bytes):
                    await self.ws.send_bytes(item.payload)
                else:
                    await self.ws.send_text(item.payload)
                if item.audio_ms:
                    self.gateway.metrics.audio_seconds.inc(item.audio_ms / 1000)
                if item.on_sent is not None:
                    item.on_sent()
        except (WebSocketDisconnect, RuntimeError, OSError):
            return

    def close_after_queue(self, code: int, reason: str = "") -> None:
        """Close once everything queued so far has been sent."""
        if self._close is None:
            self._close = (code, reason)
            self.outbox.put(Outgoing("", _CLOSE))

    def abort(self, failure: ProtocolError, code: int) -> None:
        """A fatal error: sent ahead of queued audio (after a warning still queued, which explains it), then the
        socket closes. Only the first fatal error counts."""
        if self._aborted:
            return
        self._aborted = True
        self.gateway.metrics.errors.labels(code=failure.code).inc()
        self._close = (code, failure.message[:120])
        self.outbox.put(Outgoing("", _CLOSE), urgent=True)
        self.outbox.put(Outgoing(json.dumps(error_event(failure)), None), urgent=True)
        if self._slow_warning is not None and self.outbox.take(self._slow_warning):
            self.outbox.put(self._slow_warning, urgent=True)
        # a peer that reads nothing would keep the error queued forever: close without it after a moment
        asyncio.get_running_loop().call_later(ABORT_GRACE_S, self._sender_task.cancel)

    async def _idle_watchdog(self) -> None:
        """The idle timer runs only while no context is generating or sending."""
        while True:
            await asyncio.sleep(min(1.0, self.limits.idle_timeout_s / 4))
            if self.contexts or len(self.outbox):
                self._last_activity = time.monotonic()
            elif time.monotonic() - self._last_activity > self.limits.idle_timeout_s:
                self.abort(ProtocolError("idle_timeout", f"no message for {self.limits.idle_timeout_s:g} s",
                                         fatal=True), CLOSE_IDLE)
                return

    async def shutdown(self) -> None:
        """The server stops: open contexts get a few seconds to finish, then are cancelled; close with 1001."""
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        while self.contexts and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for context_id in list(self.contexts):
            self._cancel_one(context_id, "shutdown")
        self._queue(event("session.closed", reason="shutdown"))
        self.close_after_queue(CLOSE_GOING_AWAY, "server shutting down")
        try:  # the server closes what is left of the socket after this returns
            await asyncio.wait_for(self._ended.wait(), SHUTDOWN_GRACE_S)
        except asyncio.TimeoutError:
            pass

    # --- messages ------------------------------------------------------------------------------------------------

    def inject(self, message: dict[str, Any]) -> bool:
        """A message on the client's behalf from the server's LLM proxy (`/v1/chat`): validated and handled like the
        client's own, its errors sent to the client, but outside the client's message rate. False if it was
        refused (or the session is closed)."""
        if self.closed:
            return False
        self._last_activity = time.monotonic()
        return self._handle_text(json.dumps(message), rate_limited=False)

    def context_open(self, context_id: str) -> bool:
        return not self.closed and context_id in self.contexts and not self.contexts[context_id].cancelled

    def takes_text_for(self, context_id: str) -> bool:
        """Whether text for this context would still be spoken (it is open or not yet created)."""
        return not self.closed and context_id not in self.finished and (
            context_id not in self.contexts or self.context_open(context_id))

    def _handle_text(self, text: str, rate_limited: bool = True) -> bool:
        event_id = None
        try:
            message = parse_message(text)
            event_id = message.get("event_id")
            if rate_limited and not self._limiter.allow():
                raise ProtocolError("rate_limited", f"more than {self.limits.max_message_rate:g} messages per "
                                                    "second; this message was dropped")
            if self.closing:
                raise ProtocolError("invalid_message", "the session is closing; no new messages are accepted")
            getattr(self, "_on_" + message["type"].replace(".", "_"))(message)
            return True
        except ProtocolError as failure:
            self._error(failure, event_id=event_id if event_id is not None else failure.event_id)
        except Exception:  # a bug must not take the session down, let alone the server
            log.exception("session %s: internal error", self.id)
            self._error(ProtocolError("internal", "internal server error"), event_id=event_id)
        return False

    def _on_session_start(self, message: dict[str, Any]) -> None:
        if self.text_started:
            raise ProtocolError("invalid_message", "session.start must come before the first text.append; "
                                                   "nothing was changed")
        self.config, errors = configure(self.config, message, self.gateway.voices)
        for failure in errors:
            self._error(failure, event_id=message.get("event_id"))
        self._send_started(event_id=message.get("event_id"))

    def _on_text_append(self, message: dict[str, Any]) -> None:
        context_id, text = message["context_id"], message["text"]
        self.text_started = True
        context = self._context(context_id, allow_new=True, message=message)
        if context.ended:
            raise ProtocolError("context_closed", f"context {context_id!r} has ended; use a new context_id",
                                context_id=context_id)
        if context.text_chars + len(text) > self.limits.max_text_chars:
            raise ProtocolError("text_too_long", f"a context takes at most {self.limits.max_text_chars} characters "
                                                 "of text; this append was dropped", context_id=context_id)
        context.append(text)
        if message.get("flush"):
            context.flush()

    def _on_context_flush(self, message: dict[str, Any]) -> None:
        self._context(message["context_id"]).flush()

    def _on_context_end(self, message: dict[str, Any]) -> None:
        context = self._context(message["context_id"])
        if not context.ended:
            context.end()

    def _on_mark(self, message: dict[str, Any]) -> None:
        self._context(message["context_id"]).mark(message["name"])

    def _on_context_cancel(self, message: dict[str, Any]) -> None:
        context_id = message["context_id"]
        if context_id == "*":
            for open_id in list(self.contexts):
                self._cancel_one(open_id, "client", message)
        elif context_id in self.contexts:
            self._cancel_one(context_id, "client", message)
        else:  # unknown or finished: acked all the same (idempotent), and the id is closed from now on
            self._close_id(context_id, self.finished.get(context_id, 0.0))
            self._queue(event("context.cancelled", context_id=context_id, reason="client",
                              audio_sent_ms=round(self.finished.get(context_id, 0.0), 3),
                              event_id=message.get("event_id")))

    def _on_keepalive(self, message: dict[str, Any]) -> None:
        self._last_activity = time.monotonic()

    def _on_ping(self, message: dict[str, Any]) -> None:
        self._queue(event("pong", id=message.get("id"), server_time_ms=int(time.time() * 1000),
                          event_id=message.get("event_id")), urgent=True)

    def _on_session_close(self, message: dict[str, Any]) -> None:
        self.closing = True
        if message.get("mode", "graceful") == "abort":
            for context_id in list(self.contexts):
                self._cancel_one(context_id, "client")
        else:
            for context in self.contexts.values():
                if not context.ended:
                    context.end()
        asyncio.get_running_loop().create_task(self._close_when_done())

    async def _close_when_done(self) -> None:
        while self.contexts:
            await asyncio.sleep(0.02)
        self._queue(event("session.closed"))
        self.close_after_queue(CLOSE_NORMAL, "session closed")

    # --- contexts ------------------------------------------------------------------------------------------------

    def _context(self, context_id: str, allow_new: bool = False, message: dict | None = None) -> ContextStream:
        context = self.contexts.get(context_id)
        if context is not None:
            return context
        if context_id in self.finished:
            raise ProtocolError("context_closed", f"context {context_id!r} has finished; use a new context_id",
                                context_id=context_id)
        if context_id == "*":
            raise ProtocolError("invalid_message", "\"*\" is only for context.cancel", context_id=context_id)
        if not allow_new:
            raise ProtocolError("context_not_found", f"no context {context_id!r}; a text.append creates it",
                                context_id=context_id)
        return self._open(context_id, message)

    def _open(self, context_id: str, message: dict[str, Any]) -> ContextStream:
        if len(self.contexts) >= self.limits.max_contexts:
            raise ProtocolError("context_limit", f"at most {self.limits.max_contexts} open contexts per session",
                                context_id=context_id)
        voice_id = message.get("voice") or self.config.voice or self.gateway.voices.default
        instructions = message.get("instructions") or self.config.instructions
        try:
            voice = self.gateway.voices.resolve(voice_id, instructions)
            template = self.gateway.template(voice, message.get("language") or self.config.language,
                                             self.config.sampling)
        except VoiceError as failure:
            raise ProtocolError(failure.code, str(failure), context_id=context_id) from None
        except RequestError as failure:
            raise ProtocolError("invalid_config", str(failure), context_id=context_id) from None
        speech = self.gateway.speech_context(template, self.config.buffering, self.config.max_buffer_delay_ms)
        stream_id = self._stream_ids
        self._stream_ids = (self._stream_ids + 1) % 65536
        context = ContextStream(context_id, stream_id, voice_id, speech, self.config.audio, self.config.transport,
                                self.outbox, self.gateway.metrics, self.limits.send_queue_ms, self._slow,
                                self._finished, timestamps=self.config.timestamps == "word")
        self.contexts[context_id] = context
        self.gateway.metrics.contexts_active.inc()
        self._queue(event("context.started", context_id=context_id, stream_id=stream_id, voice=voice_id,
                          event_id=message.get("event_id")))
        return context

    def _finished(self, context: ContextStream) -> None:
        if self.contexts.pop(context.context_id, None) is not None:
            self.gateway.metrics.contexts_active.dec()
        self._close_id(context.context_id, context.stats.audio_sent_ms)

    def _cancel_one(self, context_id: str, reason: str, message: dict | None = None) -> None:
        context = self.contexts.pop(context_id)
        self.gateway.metrics.contexts_active.dec()
        context.cancel()
        self._close_id(context_id, context.stats.audio_sent_ms)
        played_ms = (message or {}).get("played_ms")
        ack = event("context.cancelled", context_id=context_id, audio_sent_ms=round(context.stats.audio_sent_ms, 3),
                    reason=reason, heard_text=context.heard_text(played_ms) if played_ms is not None else None,
                    event_id=(message or {}).get("event_id"))
        self._queue(ack)

    def _close_id(self, context_id: str, audio_sent_ms: float) -> None:
        """The id cannot be used again; only the newest MAX_CLOSED_IDS are remembered, so memory stays bounded."""
        self.finished.pop(context_id, None)
        self.finished[context_id] = audio_sent_ms
        if len(self.finished) > MAX_CLOSED_IDS:
            del self.finished[next(iter(self.finished))]

    def _slow(self, past_hard_limit: bool) -> None:
        """The client reads too slowly: a warning once, and past the hard limit a fatal error after it."""
        if self._slow_warning is None:
            self._slow_warning = Outgoing(json.dumps(event(
                "warning", code="slow_consumer", message="the client reads audio slower than it is made; synthesis "
                "pauses until it catches up")))
            self.outbox.put(self._slow_warning, urgent=True)
        if past_hard_limit:
            self.abort(ProtocolError("slow_consumer", "the client does not read its audio; closing", fatal=True),
                       CLOSE_POLICY)

    # --- output --------------------------------------------------------------------------------------------------

    def _send_started(self, event_id: Any = None) -> None:
        limits = self.limits
        pre_skip = StreamEncoder(self.config.audio).pre_skip
        self._queue(event("session.started", session_id=self.id, protocol=PROTOCOL, model=self.gateway.model_name,
                          voice=self.config.voice or self.gateway.voices.default,
                          audio=audio_description(self.config.audio, pre_skip), transport={"audio": self.config.transport},
                          text={"buffering": self.config.buffering,
                                "max_buffer_delay_ms": self.config.max_buffer_delay_ms},
                          timestamps=self.config.timestamps,
                          limits={"max_contexts": limits.max_contexts, "max_text_chars": limits.max_text_chars,
                                  "max_message_bytes": limits.max_message_bytes,
                                  "idle_timeout_s": limits.idle_timeout_s},
                          event_id=event_id))

    def _error(self, failure: ProtocolError, event_id: Any = None) -> None:
        self.gateway.metrics.errors.labels(code=failure.code).inc()
        self._queue(error_event(failure, event_id))

    def _queue(self, message: dict[str, Any], urgent: bool = False) -> None:
        self.outbox.put(Outgoing(json.dumps(message)), urgent=urgent)


_CLOSE = "\0close"  # the outbox item after which the sender stops
