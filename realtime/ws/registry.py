"""A session's contexts: opening them (within the session's limit, with their voice and stream id), finding them for
a message, cancelling and closing them, and remembering closed ids so that none is used twice."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from realtime.audio.encoder_pool import EncoderFailed
from realtime.gateway import Gateway
from realtime.voices import VoiceError
from realtime.ws.backpressure import SlowConsumerPolicy
from realtime.ws.contexts import SessionContext
from realtime.ws.framing import AudioFramer
from realtime.ws.outbox import Outbox
from realtime.ws.protocol import CONTEXT_FIELDS, ProtocolError, event
from realtime.ws.settings import SessionSettings

# Context ids one session may use over its life: each closed id is remembered so that none is reused (PROTOCOL.md),
# and this bounds that memory. A voice chat with a context a turn runs for hours within it.
MAX_CONTEXT_IDS = 10_000
STREAM_IDS = 65536  # stream_id is a u16 of the binary header


class ContextRegistry:
    def __init__(self, gateway: Gateway, settings: SessionSettings, outbox: Outbox, slow: SlowConsumerPolicy,
                 owner: str) -> None:
        """`owner`: the session's id, its contexts' owner in the engine: sessions take turns for its slots."""
        self.gateway, self.settings, self.outbox, self.slow, self.owner = gateway, settings, outbox, slow, owner
        self.max_contexts = gateway.limits.max_contexts
        self.open: dict[str, SessionContext] = {}
        self.finished: dict[str, float] = {}  # closed context id -> audio sent (ms)
        self._next_stream_id = 0

    def __len__(self) -> int:
        return len(self.open)

    def __iter__(self) -> Iterator[SessionContext]:
        return iter(list(self.open.values()))

    def is_open(self, context_id: str) -> bool:
        return context_id in self.open and not self.open[context_id].cancelled

    def takes_text_for(self, context_id: str) -> bool:
        """Whether text for this context would still be spoken (it is open or not yet created)."""
        return context_id not in self.finished and (context_id not in self.open or self.is_open(context_id))

    def find(self, context_id: str) -> SessionContext:
        """The open context; raises ProtocolError for a finished, unknown or `*` id."""
        context = self.open.get(context_id)
        if context is not None:
            return context
        if context_id in self.finished:
            raise ProtocolError("context_closed", f"context {context_id!r} has finished; use a new context_id",
                                context_id=context_id)
        if context_id == "*":
            raise ProtocolError("invalid_message", "\"*\" is only for context.cancel", context_id=context_id)
        raise ProtocolError("context_not_found", f"no context {context_id!r}; a text.append creates it",
                            context_id=context_id)

    def find_or_open(self, context_id: str, message: dict[str, Any]) -> SessionContext:
        """For a text.append: the open context, or a new one with the message's voice fields."""
        try:
            return self.find(context_id)
        except ProtocolError as failure:
            if failure.code != "context_not_found":
                raise
        return self._open(context_id, message)

    def _open(self, context_id: str, message: dict[str, Any]) -> SessionContext:
        if len(self.open) >= self.max_contexts:
            raise ProtocolError("context_limit", f"at most {self.max_contexts} open contexts per session",
                                context_id=context_id)
        if self._ids_used() >= MAX_CONTEXT_IDS:
            raise ProtocolError("context_limit", f"this session has used its {MAX_CONTEXT_IDS} context ids (closed "
                                                 f"ids are kept, so that none is reused); open a new session",
                                context_id=context_id)
        config = self.settings.config
        voice_id, instructions, language = self.settings.context_fields(message)
        voice_id = voice_id or self.gateway.voices.default
        if message.get("instructions") is None and voice_id and not self.gateway.voices.takes_instructions(voice_id):
            instructions = None  # the session's instructions describe its voices; a stored voice keeps its own
        try:
            voice = self.gateway.voices.resolve(voice_id, instructions)
            template = self.gateway.template(voice, language, config.sampling, owner=self.owner)
        except VoiceError as failure:  # an unknown voice or language
            raise ProtocolError(failure.code, str(failure), context_id=context_id) from None
        lexicon = self.settings.context_lexicon(message)
        try:  # first: a context that cannot encode starts nothing
            framer = AudioFramer(context_id, self._new_stream_id(), config.audio, config.transport,
                                 self.gateway.encoders)
        except EncoderFailed as failure:
            raise ProtocolError("overloaded", str(failure), context_id=context_id) from None
        speech = self.gateway.speech_context(template, config.buffering, config.max_buffer_delay_ms, lexicon)
        context = SessionContext(context_id, speech, framer, self.outbox, self.gateway.metrics, self.slow,
                                 self._finished, timestamps=config.timestamps == "word",
                                 clean_text=self.gateway.options.clean_text)
        context.opened_with = {name: message.get(name) for name in CONTEXT_FIELDS}
        self.open[context_id] = context
        self.gateway.metrics.contexts_active.inc()
        self.outbox.put_event(event("context.started", context_id=context_id, stream_id=framer.stream_id,
                                    voice=self.gateway.voices.canonical(voice_id), event_id=message.get("event_id")))
        return context

    def _new_stream_id(self) -> int:
        """The next stream id no open context holds: ids wrap after STREAM_IDS contexts, and one context may stay
        open across the wrap (its frames would be read as the new one's)."""
        in_use = {context.framer.stream_id for context in self.open.values()}
        while self._next_stream_id in in_use:
            self._next_stream_id = (self._next_stream_id + 1) % STREAM_IDS
        stream_id, self._next_stream_id = self._next_stream_id, (self._next_stream_id + 1) % STREAM_IDS
        return stream_id

    def cancel(self, context_id: str, reason: str, message: dict[str, Any] | None = None,
               urgent: bool = False) -> None:
        """Cancel an open context, or ack an unknown or finished one all the same (idempotent: the id is closed
        from now on); `message` is the client's context.cancel (its played_ms and event_id); `urgent`: the ack goes
        ahead of what is queued (a fatal error's close follows it)."""
        message = message or {}
        context = self.open.pop(context_id, None)
        if context is None:
            audio_sent_ms = self.finished.get(context_id, 0.0)
            if context_id in self.finished or self._ids_used() < MAX_CONTEXT_IDS:
                self._close_id(context_id, audio_sent_ms)  # past the limit no new id opens anyway
            self.outbox.put_event(event("context.cancelled", context_id=context_id, reason=reason,
                                        audio_sent_ms=round(audio_sent_ms, 3), event_id=message.get("event_id")),
                                  urgent=urgent)
            return
        self.gateway.metrics.contexts_active.dec()
        context.cancel()
        self._close_id(context_id, context.stats.audio_sent_ms)
        played_ms = message.get("played_ms")
        self.outbox.put_event(event(
            "context.cancelled", context_id=context_id, audio_sent_ms=round(context.stats.audio_sent_ms, 3),
            reason=reason, heard_text=context.heard_text(played_ms) if played_ms is not None else None,
            event_id=message.get("event_id")), urgent=urgent)

    def cancel_all(self, reason: str, message: dict[str, Any] | None = None, urgent: bool = False) -> None:
        """Cancel every open context (`context_id: "*"`, an abort, a shutdown); nothing to ack when none is."""
        for context_id in list(self.open):
            self.cancel(context_id, reason, message, urgent)

    def end_all(self) -> None:
        for context in self.open.values():
            if not context.ended:
                context.end()

    def drop_all(self) -> None:
        """The socket is gone: stop every context, acking nothing."""
        for context in self.open.values():
            context.cancel()
        self.gateway.metrics.contexts_active.dec(len(self.open))
        self.open.clear()

    def _finished(self, context: SessionContext) -> None:
        if self.open.pop(context.context_id, None) is not None:
            self.gateway.metrics.contexts_active.dec()
        self._close_id(context.context_id, context.stats.audio_sent_ms)

    def _close_id(self, context_id: str, audio_sent_ms: float) -> None:
        """The id cannot be used again. Every id is kept: at most MAX_CONTEXT_IDS and the contexts open when the
        session reached it (forgetting the oldest let a long session reuse an id, and get two dones for it)."""
        self.finished[context_id] = audio_sent_ms

    def _ids_used(self) -> int:
        return len(self.finished) + len(self.open)
