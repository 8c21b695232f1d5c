"""One voxgate.v1 WebSocket session's life cycle: reading client messages and handing each to its handler, sending
the outbox in order, the idle timer, and closing (PROTOCOL.md is the contract; docs/protocol.md says where it is
silent). Contexts live in the registry, the configuration in the settings, slow clients in the backpressure policy."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from realtime.audio.encoders import pre_skip
from realtime.gateway import Gateway
from realtime.lexicon import MAX_RULES, compile_off_loop
from realtime.ws.backpressure import SlowConsumerPolicy
from realtime.ws.contexts import SessionContext
from realtime.ws.outbox import Outbox, Outgoing
from realtime.ws.protocol import (
    CLOSE_GOING_AWAY,
    CLOSE_IDLE,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    CONTEXT_FIELDS,
    SEND_NOW_EXTENSION,
    WRITE_NOW_EXTENSION,
    ProtocolError,
    SessionConfig,
    check_message,
    error_event,
    event,
    never_dropped,
    parse_message,
    session_started,
    valid_unicode,
)
from realtime.ws.rate_limit import MessageBudget, RateLimiter
from realtime.ws.registry import ContextRegistry
from realtime.ws.settings import SessionSettings

log = logging.getLogger("voxgate")
SHUTDOWN_GRACE_S = 5.0
# inline lexicon rules a session may have compiled a second (bursts of twice that): each compile holds the GIL
# (~0.2 s for 1,000 rules), and a hostile try starved the engine with a new 1,000-rule lexicon every 50 ms
INLINE_RULES_RATE = 500
ABORT_GRACE_S = 2.0


class Session:
    def __init__(self, websocket: WebSocket, gateway: Gateway, config: SessionConfig, owner: str | None) -> None:
        """`owner`: the API key the socket presented (None on an open gateway): only a chat socket with the same
        key may speak into this session (chat.py)."""
        self.ws, self.gateway = websocket, gateway
        self.limits = gateway.limits
        self.id = uuid.uuid4().hex
        self.owner = owner
        self.outbox = Outbox()
        self.settings = SessionSettings(config, gateway.voices, gateway.lexicons)
        self.slow = SlowConsumerPolicy(self.outbox, self.limits.send_queue_ms,
                                       lambda failure: self.abort(failure, CLOSE_POLICY))
        self.contexts = ContextRegistry(gateway, self.settings, self.outbox, self.slow, self.id)
        self.closing = False
        self.closed = False  # the socket is gone
        self._aborted = False
        self._budget = MessageBudget(self.limits.max_message_rate, self.limits.max_message_bytes)
        self._lexicon_budget = RateLimiter(INLINE_RULES_RATE)  # rules of the inline lexicons compiled
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
            self.contexts.drop_all()
            for task in (sender, watchdog, reader):
                task.cancel()
            self.closed = True
            self.gateway.sessions.discard(self)
            await self._close_socket()
            self._ended.set()

    async def _close_socket(self) -> None:
        """As long as the peer takes to read what is queued before the close (the session is no longer counted)."""
        if self._close is None:
            return
        try:
            await self.ws.close(*self._close)
        except (RuntimeError, WebSocketDisconnect, OSError):
            pass

    async def _reader(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            self._last_activity = time.monotonic()
            if message.get("bytes") is not None:  # within the same budget as text: a flood gets rate_limited
                self._error(self._budget.frame_refusal(message["bytes"]) or ProtocolError(
                    "invalid_message", "binary frames carry audio only; send JSON text frames"))
            elif message.get("text") is not None:
                await self._handle_text(message["text"])
            # messages already buffered would be handled back to back: the loop's other sockets get a turn between
            # them (300 appends of 20,000 characters held every other session's ping for 1.4 s)
            await asyncio.sleep(0)

    async def _sender(self) -> None:
        """Sends the outbox in order; a fatal error or a close item ends the session after it is sent. An item's
        messages go past the ASGI layers while the socket keeps up (`SEND_NOW_EXTENSION`); otherwise through them, a
        message at a time, the rest of the item back at the head of the outbox."""
        send_now = self.ws.scope.get("extensions", {}).get(SEND_NOW_EXTENSION)
        try:
            while True:
                item = await self.outbox.get()
                if item.closes:
                    return
                if send_now is None or not send_now(item.messages):
                    item, rest = item.split_first()
                    if rest is not None:  # while this message waits for room, a cancel may still drop the rest
                        self.outbox.put_back(rest)
                    if isinstance(item.messages[0], bytes):
                        await self.ws.send_bytes(item.messages[0])
                    else:
                        await self.ws.send_text(item.messages[0])
                if item.audio_ms:
                    self._last_activity = time.monotonic()
                    self.gateway.metrics.socket.audio_seconds.inc(item.audio_ms / 1000)
                if item.on_sent is not None:
                    item.on_sent()
        except (WebSocketDisconnect, RuntimeError, OSError):
            return

    def close_after_queue(self, code: int, reason: str = "") -> None:
        """Close once everything queued so far has been sent."""
        if self._close is None:
            self._close = (code, reason)
            self.outbox.put(Outgoing([], closes=True))

    def abort(self, failure: ProtocolError, code: int, reason: str = "error") -> None:
        """A fatal error: sent ahead of queued audio (after a warning still queued, which explains it), then a
        `context.cancelled` with `reason` (PROTOCOL.md's: `timeout` for the idle timeout) for each context still
        being made, so that it gets a final event, then the socket closes. What is still queued is dropped (a finished
        context's audio and `context.done` too). Only the first fatal error counts."""
        if self._aborted:
            return
        self._aborted = True
        self.gateway.metrics.socket.error(failure.code)
        self._close = (code, failure.message[:120])
        self.outbox.put_event(error_event(failure), urgent=True)
        self.contexts.cancel_all(reason, urgent=True)
        self.outbox.put(Outgoing([], closes=True), urgent=True)
        self.slow.warning_first()
        # a peer that reads nothing keeps the sender waiting behind its unread audio: after a moment it stops
        asyncio.get_running_loop().call_later(ABORT_GRACE_S, self._stop_sending)

    def _stop_sending(self) -> None:
        """The sender still waits behind audio the peer does not read: it stops, and what was due before the close
        (the warning, the fatal error and the cancels, PROTOCOL.md's Backpressure) is written at once behind that
        audio, where the close frame follows it, so a peer that reads again later learns why it was closed."""
        if self._sender_task is None or self._sender_task.done():
            return
        self._sender_task.cancel()
        write_now = self.ws.scope.get("extensions", {}).get(WRITE_NOW_EXTENSION)
        if write_now is not None:
            for item in self.outbox.take_until_close():
                for message in item.messages:
                    if isinstance(message, str):
                        write_now(message)

    async def _idle_watchdog(self) -> None:
        """The idle timer runs only while no context is generating or sending (PROTOCOL.md): a context held open
        with no text coming is neither, so a client that opens contexts and goes quiet does not keep its session
        (and its engine slots) for good. Audio as it goes out counts as sending."""
        while True:
            await asyncio.sleep(min(1.0, self.limits.idle_timeout_s / 4))
            if len(self.outbox) or any(context.speech.generating for context in self.contexts):
                self._last_activity = time.monotonic()  # sending, or generating with all its text in
            elif time.monotonic() - self._last_activity > self.limits.idle_timeout_s:
                self.abort(ProtocolError("idle_timeout", f"no message for {self.limits.idle_timeout_s:g} s",
                                         fatal=True), CLOSE_IDLE, reason="timeout")
                return

    async def shutdown(self) -> None:
        """The server stops: open contexts get a few seconds to finish, then are cancelled; close with 1001."""
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        while self.contexts and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.contexts.cancel_all("shutdown")
        self.outbox.put_event(event("session.closed", reason="shutdown"))
        self.close_after_queue(CLOSE_GOING_AWAY, "server shutting down")
        try:  # the server closes what is left of the socket after this returns
            await asyncio.wait_for(self._ended.wait(), SHUTDOWN_GRACE_S)
        except asyncio.TimeoutError:
            pass

    # --- the server's LLM proxy (`/v1/chat`) ---------------------------------------------------------------------
    # Messages on the client's behalf: validated and handled like the client's own, their errors sent to the
    # client, but outside the client's message rate. Each returns False if refused (or the session is closed).

    def append_text(self, context_id: str, text: str, voice_fields: dict[str, str] | None = None) -> bool:
        return self._inject(event("text.append", context_id=context_id, text=text, **(voice_fields or {})))

    def end_context(self, context_id: str) -> bool:
        return self._inject(event("context.end", context_id=context_id))

    def cancel_context(self, context_id: str) -> bool:
        return self._inject(event("context.cancel", context_id=context_id))

    def context_open(self, context_id: str) -> bool:
        return not self.closed and self.contexts.is_open(context_id)

    def context_ended(self, context_id: str) -> bool:
        """An open context whose `context.end` has come: it speaks to its end and takes nothing more."""
        context = self.contexts.open.get(context_id)
        return context is not None and context.ended

    def takes_text_for(self, context_id: str) -> bool:
        """Whether text for this context would still be spoken (it is open or not yet created)."""
        return not self.closed and self.contexts.takes_text_for(context_id)

    def _inject(self, message: dict[str, Any]) -> bool:
        if self.closed:
            return False
        self._last_activity = time.monotonic()
        return self._handle(lambda: check_message(message))

    # --- client messages -----------------------------------------------------------------------------------------

    async def _handle_text(self, text: str) -> bool:
        """A client's text frame: rate-limited before it is parsed (a flood costs no parse, valid or not; a small
        end or cancel of an open context is handled whatever the rate: `_stops_an_open_context`); an inline lexicon
        is compiled on a worker thread first (the largest takes ~0.2 s of Python: on the loop it stalled every
        socket), then the message is handled as any other."""
        message, refusal = None, self._budget.refusal(text)
        if refusal is not None and self._stops_an_open_context(never_dropped(text)):
            refusal = None
        if refusal is None:
            try:
                message = parse_message(text)
            except ProtocolError as failure:
                refusal = failure
        if message is not None and isinstance(message.get("lexicon"), list) and self._takes_lexicon(message) \
                and valid_unicode(message["lexicon"]):  # (a session.start's bad lexicon is refused with its field)
            rules = len(message["lexicon"])  # past MAX_RULES it is refused for its size before any compile: free
            if not self._lexicon_budget.allow(rules if rules <= MAX_RULES else 0):
                refusal = ProtocolError("rate_limited", f"inline lexicons of more than {INLINE_RULES_RATE} rules a "
                                                        "second; this message was dropped (a stored lexicon, POST "
                                                        "/v1/lexicons, costs nothing to name)",
                                        context_id=message.get("context_id"), event_id=message.get("event_id"))
            else:
                try:
                    message["lexicon"] = await compile_off_loop(message["lexicon"])
                except Exception:  # a bug must not take the session down
                    log.exception("session %s: compiling a lexicon failed", self.id)
                    refusal = ProtocolError("internal", "internal server error", event_id=message.get("event_id"))

        def validated() -> dict[str, Any]:
            if refusal is not None:
                raise refusal
            return message

        return self._handle(validated)

    def _stops_an_open_context(self, message: dict[str, Any] | None) -> bool:
        """Whether a small end or cancel past the rate acts on an open context (an end on one not ended yet): over
        its budget a client loses text, never leaves a context open, and a flood of them acts at most twice a
        context."""
        context_id = None if message is None else message.get("context_id")
        if context_id == "*" and message["type"] == "context.cancel":
            return len(self.contexts) > 0
        if not isinstance(context_id, str) or not self.context_open(context_id):
            return False
        return message["type"] == "context.cancel" or not self.context_ended(context_id)

    def _takes_lexicon(self, message: dict[str, Any]) -> bool:
        """Whether the message's lexicon would be used: a session.start's before text has started, a text.append's
        that opens its context (compiling one that is ignored would cost the compiler thread for nothing)."""
        if message["type"] == "session.start":
            return not self.settings.text_started and not self.closing
        return message["type"] == "text.append" and not self.closing and self.contexts.takes_text_for(
            message["context_id"]) and not self.contexts.is_open(message["context_id"])

    def _handle(self, validated: Callable[[], dict[str, Any]]) -> bool:
        """Validate a message, then hand it to its handler; any refusal becomes an `error` event, echoing the
        message's event_id."""
        event_id = None
        try:
            message = validated()
            event_id = message.get("event_id")
            if self.closing and message["type"] not in WHILE_CLOSING:
                raise ProtocolError("invalid_message", "the session is closing; no new messages are accepted",
                                    context_id=message.get("context_id"))
            HANDLERS[message["type"]](self, message)
            return True
        except ProtocolError as failure:
            self._error(failure, event_id=event_id if event_id is not None else failure.event_id)
        except Exception:  # a bug must not take the session down, let alone the server
            log.exception("session %s: internal error", self.id)
            self._error(ProtocolError("internal", "internal server error"), event_id=event_id)
        finally:
            self.slow.check_outbox(len(self.outbox))
        return False

    def _on_session_start(self, message: dict[str, Any]) -> None:
        for failure in self.settings.start(message):
            self._error(failure, event_id=message.get("event_id"))
        self._send_started(event_id=message.get("event_id"))

    def _on_text_append(self, message: dict[str, Any]) -> None:
        context_id, text = message["context_id"], message["text"]
        if len(text) > self.limits.max_text_chars:  # before the context opens: a refused first append creates none
            self._too_long(context_id)
        context = self.contexts.find_or_open(context_id, message)
        self.settings.text_started = True  # a first append refused above changes nothing, session.start included
        self._refuse_if_ended(context)
        if context.text_chars + len(text) > self.limits.max_text_chars:
            self._too_long(context_id)
        if message.get("flush") and self._closed_by_its_text(context, message):  # before the append: a refusal
            return  # this append causes is its own answer
        context.append(text, message.get("event_id"))
        if message.get("flush"):
            context.flush(message.get("event_id"))
        self._warn_ignored(context, message)

    def _warn_ignored(self, context: SessionContext, message: dict[str, Any]) -> None:
        """A later append's voice fields change nothing (PROTOCOL.md: they belong to the first): once a context, the
        first that differ from the first append's get a warning (the text was appended). The same values repeated on
        every append, as some clients send them, say nothing."""
        ignored = [name for name in CONTEXT_FIELDS
                   if message.get(name) is not None and message[name] != context.opened_with.get(name)]
        if ignored and not context.told_fields_ignored:
            context.told_fields_ignored = True
            self.outbox.put_event(event(
                "warning", code="invalid_message", context_id=context.context_id,
                message=f"{', '.join(ignored)} ignored: a context takes them from its first text.append only; its "
                        "text was appended"))

    def _too_long(self, context_id: str) -> None:
        raise ProtocolError("text_too_long", f"a context takes at most {self.limits.max_text_chars} characters of "
                                             "text; this append was dropped", context_id=context_id)

    def _on_context_flush(self, message: dict[str, Any]) -> None:
        if (context := self._answerable(message)) is not None:
            context.flush(message.get("event_id"))

    def _on_context_end(self, message: dict[str, Any]) -> None:
        self._unended(message).end(message.get("event_id"))

    def _on_mark(self, message: dict[str, Any]) -> None:
        if (context := self._answerable(message)) is not None:
            context.mark(message["name"], message.get("event_id"))

    def _unended(self, message: dict[str, Any]) -> SessionContext:
        context = self.contexts.find(message["context_id"])
        self._refuse_if_ended(context)
        return context

    def _answerable(self, message: dict[str, Any]) -> SessionContext | None:
        """The context of a flush or mark, or None when its answer is `context_closed` (`_closed_by_its_text`)."""
        context = self._unended(message)
        return None if self._closed_by_its_text(context, message) else context

    @staticmethod
    def _closed_by_its_text(context: SessionContext, message: dict[str, Any]) -> bool:
        """Whether a flush or mark comes to a context whose text passed max_text_chars (with its lexicon's
        replacements): it takes no more text, and closes nothing (what it had is spoken to its end), so it gets
        `context_closed` instead of an ack, after the context's `text_too_long` that explains it."""
        if context.speech.refusal is None:
            return False
        context.answer_after_refusal(ProtocolError(
            "context_closed", f"context {context.context_id!r} has ended: its text passed max_text_chars; use a new "
                              "context_id", context_id=context.context_id), message.get("event_id"))
        return True

    @staticmethod
    def _refuse_if_ended(context: SessionContext) -> None:
        """After `context.end` a context takes no more text, flush, mark or end: its `context.done` answers them all."""
        if context.ended:
            raise ProtocolError("context_closed", f"context {context.context_id!r} has ended (context.end); use a new "
                                                  "context_id", context_id=context.context_id)

    def _on_context_cancel(self, message: dict[str, Any]) -> None:
        if message["context_id"] == "*":
            self.contexts.cancel_all("client", message)
        else:
            self.contexts.cancel(message["context_id"], "client", message)

    def _on_keepalive(self, message: dict[str, Any]) -> None:
        self._last_activity = time.monotonic()

    def _on_ping(self, message: dict[str, Any]) -> None:
        self.outbox.put_event(event("pong", id=message.get("id"), server_time_ms=int(time.time() * 1000),
                                    event_id=message.get("event_id")), urgent=True)

    def _on_session_close(self, message: dict[str, Any]) -> None:
        """Graceful: the open contexts finish, then the close; abort (also during a graceful close): they stop, each
        `context.cancelled` echoing the abort's event_id. The one `session.closed` answers the close that began it; a
        second graceful close is refused like any message after the first."""
        if message.get("mode") == "abort":
            self.contexts.cancel_all("client", {"event_id": message.get("event_id")})  # (a close has no played_ms)
        elif self.closing:
            raise ProtocolError("invalid_message", "the session is already closing; session.close{mode: \"abort\"} "
                                                   "stops what it is finishing")
        else:
            self.contexts.end_all()
        if not self.closing:
            self.closing = True
            asyncio.get_running_loop().create_task(self._close_when_done(message.get("event_id")))

    async def _close_when_done(self, event_id: Any) -> None:
        while self.contexts:
            await asyncio.sleep(0.02)
        self.outbox.put_event(event("session.closed", event_id=event_id))
        self.close_after_queue(CLOSE_NORMAL, "session closed")

    # --- output --------------------------------------------------------------------------------------------------

    def _send_started(self, event_id: Any = None) -> None:
        config = self.settings.config
        self.settings.default_voice = self.gateway.voices.default
        self.outbox.put_event(session_started(
            self.id, self.gateway.model_name, config.voice or self.settings.default_voice, config,
            pre_skip(config.audio), self.limits, event_id))

    def _error(self, failure: ProtocolError, event_id: Any = None) -> None:
        self.gateway.metrics.socket.error(failure.code)
        self.outbox.put_event(error_event(failure, event_id))


# what a session still takes once a graceful close began: stopping what it is finishing (barge-in, abort)
WHILE_CLOSING = frozenset({"context.cancel", "session.close", "keepalive", "ping"})
# message type -> its handler (protocol.MESSAGES lists the same types)
HANDLERS: dict[str, Callable[[Session, dict[str, Any]], None]] = {
    "session.start": Session._on_session_start,
    "text.append": Session._on_text_append,
    "context.flush": Session._on_context_flush,
    "context.end": Session._on_context_end,
    "context.cancel": Session._on_context_cancel,
    "mark": Session._on_mark,
    "keepalive": Session._on_keepalive,
    "ping": Session._on_ping,
    "session.close": Session._on_session_close,
}
