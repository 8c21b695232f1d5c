"""One context of a session: a `SpeechContext` whose events are encoded into the session's audio format and queued
on the session's outbox as binary (or JSON) frames, acks and the final `context.done`.

Audio is encoded off the event loop. When the session's outbox holds `send_queue_ms` of audio the context stops
encoding (its synthesis output waits here, raw) until the client reads; past `hard_limit_ms` of waiting audio the
session is told the client is too slow (`hard_limit_ms`, four times the queue).

Word times are estimated for every context (for `heard_text`) and sent as `timestamps` events when the session asked
for them."""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from realtime.audio import AudioFormat, EncodedFrame, StreamEncoder
from realtime.errors import engine_error
from realtime.metrics import Metrics
from realtime.ws.outbox import Outbox, Outgoing
from realtime.ws.protocol import (
    FLAG_DISCONTINUITY,
    FLAG_FIRST,
    FLAG_LAST,
    ProtocolError,
    error_event,
    event,
    pack_header,
)
from realtime.ws.speech_context import ContextAudio, ContextEnd, ContextMarker, ContextText, SpeechContext
from realtime.ws.word_timing import WordTimeline

log = logging.getLogger("voxgate")
MODEL_SAMPLE_RATE = 24000


@dataclass
class ContextStats:
    created_at: float = field(default_factory=time.monotonic)
    speaking_since: float | None = None  # when its text started speaking (PROTOCOL.md "Timing")
    first_audio_sent_at: float | None = None
    audio_sent_ms: float = 0.0


class ContextStream:
    def __init__(self, context_id: str, stream_id: int, voice: str, speech: SpeechContext, fmt: AudioFormat,
                 transport: str, outbox: Outbox, metrics: Metrics, send_queue_ms: float,
                 on_slow: Callable[[bool], None], on_finished: Callable[["ContextStream"], None],
                 timestamps: bool = False) -> None:
        self.context_id, self.stream_id, self.voice = context_id, stream_id, voice
        self.speech = speech
        self.format, self.transport = fmt, transport
        self.outbox, self.metrics = outbox, metrics
        self.send_queue_ms = send_queue_ms
        self.hard_limit_ms = 4 * send_queue_ms
        self.on_slow, self.on_finished = on_slow, on_finished
        self.encoder = StreamEncoder(fmt)
        self.stats = ContextStats()
        self.text_chars = 0
        self.ended = False  # no more text (context.end)
        self.cancelled = False
        self._seq = 0
        self._sent_first = False
        self._pts_base = 0  # output samples of the encoders before the current one
        self._discontinuity = False
        self._waiting_ms = 0.0  # synthesized audio not yet encoded (the client reads too slowly)
        self.words = WordTimeline()
        self.timestamps = timestamps
        self._model_samples = 0  # synthesized samples taken in order (those waiting for a slow client included)
        self._encoded_samples = 0  # synthesized samples given to the current encoder
        self._padding_s = 0.0  # silence the drained encoders added (a flush, a mark): later audio starts later
        self._task = asyncio.get_running_loop().create_task(self._run())

    # --- text in -------------------------------------------------------------------------------------------------

    def append(self, text: str) -> None:
        self.text_chars += len(text)
        if text:
            self.speech.append(text)
        self._note_speaking()

    def flush(self) -> None:
        self.speech.flush()
        self._note_speaking()

    def mark(self, name: str) -> None:
        self.speech.mark(name)
        self._note_speaking()

    def end(self) -> None:
        self.ended = True
        self.speech.end()
        self._note_speaking()

    def _note_speaking(self) -> None:
        utterances = self.speech.planner.utterances
        if self.stats.speaking_since is None and utterances and utterances[0].started:
            self.stats.speaking_since = time.monotonic()

    def cancel(self) -> None:
        """Stop at once; nothing of this context is queued after this returns."""
        self.cancelled = True
        self.speech.cancel()
        self._task.cancel()
        self.stats.audio_sent_ms -= self.outbox.drop(self.context_id)

    # --- audio out -----------------------------------------------------------------------------------------------

    async def _run(self) -> None:
        """Take the synthesis output as it comes (so that audio waiting for a slow client is counted), and send it
        in order while the outbox has room."""
        backlog: asyncio.Queue = asyncio.Queue()
        collector = asyncio.get_running_loop().create_task(self._collect(backlog))
        try:
            while True:
                item = await backlog.get()
                if isinstance(item, ContextAudio):
                    await self._send_audio(item)
                elif isinstance(item, ContextText):
                    self._time_words(item)
                elif isinstance(item, ContextMarker):
                    await self._send_marker(item)
                else:
                    await self._finish(item)
                    break
        except Exception as failure:  # a bug here must still end the context: an error, then context.done
            log.exception("context failed")
            self._end_failed(failure)
        finally:
            collector.cancel()
        self.on_finished(self)

    async def _collect(self, backlog: asyncio.Queue) -> None:
        async for item in self.speech.events():
            if isinstance(item, ContextAudio):
                self._waiting_ms += len(item.samples) / MODEL_SAMPLE_RATE * 1000
                if self._waiting_ms > self.hard_limit_ms:
                    self.on_slow(True)
            backlog.put_nowait(item)

    def _time_words(self, text: ContextText) -> None:
        audio_end_s = self._model_samples / MODEL_SAMPLE_RATE + self._padding_s
        words = self.words.add(text.utterance, text.text, text.final, audio_end_s)
        if words and self.timestamps and not self.cancelled:
            self._queue(event("timestamps", context_id=self.context_id, words=[w.text for w in words],
                              start=[round(w.start_s, 3) for w in words], end=[round(w.end_s, 3) for w in words],
                              estimated=True))

    def heard_text(self, played_ms: float) -> str:
        return self.words.heard_text(min(played_ms, self.stats.audio_sent_ms) / 1000)

    async def _send_audio(self, audio: ContextAudio) -> None:
        self._model_samples += len(audio.samples)
        if self.outbox.queued_ms >= self.send_queue_ms:
            self.on_slow(False)
            await self.outbox.below(self.send_queue_ms)
        frames = await asyncio.to_thread(self.encoder.encode, audio.samples)
        self._encoded_samples += len(audio.samples)
        self._waiting_ms -= len(audio.samples) / MODEL_SAMPLE_RATE * 1000
        if not self.cancelled:
            self._queue_frames(frames, last=False)

    async def _send_marker(self, marker: ContextMarker) -> None:
        await self._drain()
        if self.cancelled:
            return
        if marker.kind == "flush":
            self._queue(event("context.flushed", context_id=self.context_id, flush_id=int(marker.name)))
        else:
            pts_ms = round(self._samples_out / self.format.sample_rate * 1000, 3)
            self._queue(event("mark", context_id=self.context_id, name=marker.name, pts_ms=pts_ms))

    async def _drain(self) -> None:
        """A flush or mark promises that all audio before it has been sent: the encoder gives out what it holds
        (Opus: its lookahead, the last packet padded), and later audio starts a fresh encoder. For Opus that
        frame is flagged DISCONTINUITY: a decoder resets and drops `pre_skip` samples again."""
        frames = await asyncio.to_thread(self.encoder.finish)
        if self.cancelled:
            return
        self._queue_frames(frames, last=False)
        if self.encoder.samples_out:
            self._pts_base += self.encoder.samples_out
            self._padding_s += (self.encoder.samples_out / self.format.sample_rate
                                - self._encoded_samples / MODEL_SAMPLE_RATE)
            self._encoded_samples = 0
            self.encoder = StreamEncoder(self.format)
            self._discontinuity = self.format.encoding == "opus"

    @property
    def _samples_out(self) -> int:
        return self._pts_base + self.encoder.samples_out

    async def _finish(self, end: ContextEnd) -> None:
        frames = await asyncio.to_thread(self.encoder.finish)
        if self.cancelled:
            return
        if frames or self._sent_first:
            self._queue_frames(frames, last=True)
        if end.reason == "error":
            self._queue_error(engine_error(end.error, self.context_id))
        self._queue_done()

    def _end_failed(self, failure: Exception) -> None:
        if self.cancelled:
            return
        if self._sent_first:
            self._queue_frames([], last=True)
        self._queue_error(engine_error(failure, self.context_id))
        self._queue_done()

    def _queue_error(self, failure: ProtocolError) -> None:
        self.metrics.errors.labels(code=failure.code).inc()
        self._queue(error_event(failure))

    def _queue_done(self) -> None:
        audio_ms = self._samples_out / self.format.sample_rate * 1000
        self._queue(event("context.done", context_id=self.context_id, audio_ms=round(audio_ms, 3),
                          metrics=self._final_metrics(audio_ms)))

    def _final_metrics(self, audio_ms: float) -> dict:
        stats = self.stats
        ttfa = (stats.first_audio_sent_at - self._speaking_since()) * 1000 if stats.first_audio_sent_at else None
        wall = time.monotonic() - (self._speaking_since() or stats.created_at)
        return {"ttfa_ms": round(ttfa, 1) if ttfa is not None else None,
                "rtf": round(wall / (audio_ms / 1000), 3) if audio_ms else None,
                "text_chars": self.text_chars}

    def _speaking_since(self) -> float:
        """When the text started speaking: a flush or end (seen as it came), else the planner's start (a clause
        boundary or the buffering delay, noted when the context's task polled it)."""
        if self.stats.speaking_since is None:
            utterances = self.speech.planner.utterances
            started = utterances[0].started_at if utterances else None
            self.stats.speaking_since = started if started is not None else self.stats.created_at
        return self.stats.speaking_since

    def _queue_frames(self, frames: list[EncodedFrame], last: bool) -> None:
        if last and not frames:  # all audio already went out: an empty frame carries the LAST flag
            frames = [EncodedFrame(b"", self.encoder.samples_out, 0)]
        for i, frame in enumerate(frames):
            flags = (FLAG_FIRST if not self._sent_first else 0) | (FLAG_LAST if last and i == len(frames) - 1 else 0)
            if self._discontinuity and frame.payload:
                flags |= FLAG_DISCONTINUITY
                self._discontinuity = False
            frame = replace(frame, pts=self._pts_base + frame.pts)
            first = not self._sent_first
            self._sent_first = True
            ms = frame.samples / self.format.sample_rate * 1000
            self.outbox.put(Outgoing(self._frame_payload(frame, flags), self.context_id, ms,
                                     self._first_sent if first else None))
            self.stats.audio_sent_ms += ms

    def _first_sent(self) -> None:
        self.stats.first_audio_sent_at = time.monotonic()
        self.metrics.ttfa.observe(self.stats.first_audio_sent_at - self._speaking_since())

    def _frame_payload(self, frame: EncodedFrame, flags: int) -> str | bytes:
        if self.transport == "binary":
            return pack_header(flags, self.stream_id, frame.pts) + frame.payload
        message = event("audio", context_id=self.context_id, seq=self._seq,
                        pts_ms=round(frame.pts / self.format.sample_rate * 1000, 3),
                        duration_ms=round(frame.samples / self.format.sample_rate * 1000, 3),
                        data=base64.b64encode(frame.payload).decode("ascii"),
                        first=True if flags & FLAG_FIRST else None, last=True if flags & FLAG_LAST else None)
        self._seq += 1
        return json.dumps(message)

    def _queue(self, message: dict) -> None:
        self.outbox.put(Outgoing(json.dumps(message), self.context_id))
