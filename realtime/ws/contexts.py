"""One context of a session: a `SpeechContext`'s events turned into what the client receives, in order: audio frames
(framing.py), `timestamps`, `context.flushed` and `mark` acks, errors and the final `context.done`.

Synthesis output is taken as it comes and waits here, raw, while the slow-consumer policy holds the encoding back
(backpressure.py); that waiting audio is what the policy's hard limit counts.

Word times are estimated for every context (for `heard_text`) and sent as `timestamps` events when the session asked
for them."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from engine.errors import EmptyText, VoxgateError
from realtime.audio.formats import MODEL_SAMPLE_RATE, EncodedFrame
from realtime.errors import engine_error
from realtime.metrics import Metrics
from realtime.ws.backpressure import SlowConsumerPolicy
from realtime.ws.context_metrics import ContextStats
from realtime.ws.framing import AudioFramer
from realtime.ws.outbox import Outbox
from realtime.ws.protocol import ProtocolError, error_event, event
from realtime.ws.speech_context import ContextAudio, ContextEnd, ContextMarker, ContextText, SpeechContext
from realtime.ws.word_timing import WordTimeline

log = logging.getLogger("voxgate")


class SessionContext:
    def __init__(self, context_id: str, speech: SpeechContext, framer: AudioFramer, outbox: Outbox,
                 metrics: Metrics, slow: SlowConsumerPolicy, on_finished: Callable[["SessionContext"], None],
                 timestamps: bool = False, clean_text: bool = True) -> None:
        self.context_id, self.stream_id = context_id, framer.stream_id
        self.speech, self.framer = speech, framer
        self.outbox, self.metrics, self.slow = outbox, metrics, slow
        self.on_finished = on_finished
        self.stats = ContextStats()
        self.text_chars = 0
        self.ended = False  # no more text (context.end)
        self.end_event_id: Any = None  # the context.end's, echoed on context.done
        self.refused_event_id: Any = None  # the message whose text passed the limit, echoed on its error
        self.text_event_id: Any = None  # the last message that gave it text (a refusal the text pause released)
        self._after_refusal: list[tuple[ProtocolError, Any]] = []  # answers queued behind its text_too_long
        self.cancelled = False
        self.opened_with: dict[str, Any] = {}  # the first append's voice fields (CONTEXT_FIELDS)
        self.told_fields_ignored = False  # a later append's other voice fields were warned about (once)
        self.words = WordTimeline(clean_text)
        self.timestamps = timestamps
        self._waiting_ms = 0.0  # synthesized audio not yet encoded (the client reads too slowly)
        self._model_samples = 0  # synthesized samples taken in order (those waiting for a slow client included)
        self._paused_too_long: asyncio.TimerHandle | None = None  # while synthesis is paused for a slow client
        speech.on_audio = self._audio_came
        self._task = asyncio.get_running_loop().create_task(self._run())

    # --- text in -------------------------------------------------------------------------------------------------

    def append(self, text: str, event_id: Any = None) -> None:
        self.text_chars += len(text)
        if text:
            self.text_event_id = event_id
            self.speech.append(text)
        self._noted(event_id)

    def flush(self, event_id: Any = None) -> None:
        """`event_id`: the client message's, echoed on its `context.flushed` (as on a `mark` and `context.done`)."""
        self.speech.flush(event_id)
        self._noted(event_id)

    def mark(self, name: str, event_id: Any = None) -> None:
        self.speech.mark(name, event_id)
        self._noted(event_id)

    def end(self, event_id: Any = None) -> None:
        self.ended = True
        self.end_event_id = event_id
        self.speech.end()
        self._noted(event_id)

    def answer_after_refusal(self, failure: ProtocolError, event_id: Any = None) -> None:
        """A message the context refuses because its text passed the limit: its error goes out after the context's
        `text_too_long`, which explains it and waits for the audio made before it (`_finish`)."""
        self._after_refusal.append((failure, event_id))

    def _noted(self, event_id: Any) -> None:
        """After a message gave the context text (an append, or a flush, mark or end that releases what the lexicon
        held): the message that made its text too long is the one its error answers."""
        if self.speech.refusal is not None and self.refused_event_id is None:
            self.refused_event_id = event_id
        self.stats.note_speaking(self.speech.planner)

    def cancel(self) -> None:
        """Stop at once; nothing of this context is queued after this returns."""
        self.cancelled = True
        self.speech.cancel()
        self._task.cancel()
        self.framer.close()  # here too: a task cancelled before it ran never reaches its own `finally`
        self.stats.audio_sent_ms -= self.outbox.drop(self.context_id)

    def heard_text(self, played_ms: float) -> str:
        return self.words.heard_text(min(played_ms, self.stats.audio_sent_ms) / 1000)

    # --- events out ----------------------------------------------------------------------------------------------

    async def _run(self) -> None:
        """Send the synthesis output in order while the outbox has room (the audio waiting meanwhile is counted as it
        comes, `_audio_came`)."""
        try:
            async for item in self.speech.events():
                if isinstance(item, ContextAudio):
                    await self._send_audio(item)
                elif isinstance(item, ContextText):
                    self._time_words(item)
                elif isinstance(item, ContextMarker):
                    await self._send_marker(item)
                else:  # the end: the events end with it
                    await self._finish(item)
        except Exception as failure:  # a bug here must still end the context: an error, then context.done
            log.exception("context failed")
            self.speech.cancel()  # its engine request (perhaps paused) gives its slot back
            self._end_failed(failure)
        finally:
            self._resumed()
            self.framer.close()
        self.on_finished(self)

    def _audio_came(self, samples: int) -> None:
        """Synthesis queued audio (`SpeechContext.on_audio`), perhaps while this context still waits for the client
        to take what came before: as much waiting pauses synthesis, and far more ends a session that reads nothing.
        Counted here, as it comes, not when this context's task gets to it (a task between them cost every chunk
        one more turn of the loop)."""
        self._waiting_ms += samples / MODEL_SAMPLE_RATE * 1000
        self.slow.check_backlog(self._waiting_ms)
        if self.slow.should_pause(self._waiting_ms):
            self._pause()

    def _pause(self) -> None:
        """Pause synthesis while the client takes too little audio; a pause that outlasts the hard limit's time ends
        the session (a client that reads a chunk now and then would hold the engine slot for good)."""
        if self._paused_too_long is None:
            self._paused_too_long = asyncio.get_running_loop().call_later(self.slow.hard_limit_ms / 1000,
                                                                           self.slow.paused_too_long)
        self.speech.pause(True)

    def _resumed(self) -> None:
        if self._paused_too_long is not None:
            self._paused_too_long.cancel()
            self._paused_too_long = None

    def _time_words(self, text: ContextText) -> None:
        audio_end_s = self._model_samples / MODEL_SAMPLE_RATE + self.framer.padding_s
        words = self.words.add(text.utterance, text.text, text.final, audio_end_s)
        if words and self.timestamps and not self.cancelled:
            self._queue(event("timestamps", context_id=self.context_id, words=[w.text for w in words],
                              start=[round(w.start_s, 3) for w in words], end=[round(w.end_s, 3) for w in words],
                              estimated=True))

    async def _send_audio(self, audio: ContextAudio) -> None:
        self._model_samples += len(audio.samples)
        await self.slow.wait_for_room()
        if self.cancelled:  # while it waited (a slow consumer's abort cancels it from within that wait)
            return
        frames = await self.framer.encode(audio.samples)
        self._waiting_ms -= len(audio.samples) / MODEL_SAMPLE_RATE * 1000
        if self.slow.may_resume(self._waiting_ms):
            self._resumed()
            self.speech.pause(False)
        if not self.cancelled:
            self._queue_frames(frames, last=False)

    async def _send_marker(self, marker: ContextMarker) -> None:
        await self._drain()
        if self.cancelled:
            return
        if marker.kind == "flush":
            self._queue(event("context.flushed", context_id=self.context_id, flush_id=int(marker.name),
                              event_id=marker.event_id))
        else:
            pts_ms = round(self.framer.samples_out / self.framer.format.sample_rate * 1000, 3)
            self._queue(event("mark", context_id=self.context_id, name=marker.name, pts_ms=pts_ms,
                              event_id=marker.event_id))

    async def _drain(self) -> None:
        """A flush or mark promises that all audio before it has been sent: the encoder gives out what it holds,
        and later audio starts a fresh one."""
        frames = await self.framer.finish(whole_frame=True)  # only a context's last frame may be shorter
        if self.cancelled:
            return
        self._queue_frames(frames, last=False)
        self.framer.restart()

    async def _finish(self, end: ContextEnd) -> None:
        frames = await self.framer.finish()
        if self.cancelled:
            return
        if frames or self.framer.sent_first:
            self._queue_frames(frames, last=True)
        if end.reason == "error":
            self._queue_error(engine_error(end.error, self.context_id), self._answered_by(end.error))
        for failure, event_id in self._after_refusal:
            self._queue_error(failure, event_id)
        self._queue_done()

    def _answered_by(self, error: VoxgateError | None) -> Any:
        """The event_id of the message a context's error answers: the text that took it past the limit, or the end
        of a context with nothing to say (`empty_text`); an engine's failure answers no message."""
        if error is not None and error is self.speech.refusal:
            return self.refused_event_id if self.refused_event_id is not None else self.text_event_id
        return self.end_event_id if isinstance(error, EmptyText) else None

    def _end_failed(self, failure: Exception) -> None:
        if self.cancelled:
            return
        if self.framer.sent_first:
            self._queue_frames([], last=True)
        self._queue_error(engine_error(failure, self.context_id))
        self._queue_done()

    def _queue_error(self, failure: ProtocolError, event_id: Any = None) -> None:
        self.metrics.socket.error(failure.code)
        self._queue(error_event(failure, event_id))

    def _queue_done(self) -> None:
        audio_ms = self.framer.samples_out / self.framer.format.sample_rate * 1000
        self._queue(event("context.done", context_id=self.context_id, audio_ms=round(audio_ms, 3),
                          metrics=self.stats.summary(self.speech.planner, audio_ms, self.text_chars),
                          event_id=self.end_event_id))

    def _queue_frames(self, frames: list[EncodedFrame], last: bool) -> None:
        item = self.framer.outgoing(frames, last, self._first_sent)
        if item is not None:
            self.outbox.put(item)
            self.stats.audio_sent_ms += item.audio_ms

    def _first_sent(self) -> None:
        self.stats.first_sent(self.speech.planner, self.metrics)

    def _queue(self, message: dict) -> None:
        self.outbox.put_event(message, self.context_id)
