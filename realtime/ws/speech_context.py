"""A context: text that keeps arriving, spoken as a sequence of utterances with one continuous audio timeline.

The gateway's contexts sit on this. Text goes through an `UtterancePlanner` (buffering, utterance boundaries);
each utterance becomes one streaming-text request of the engine's front end (in the prefill text layout, one
complete-text request once the utterance closes), run one after another so that the audio stays in order and
sample positions keep counting across utterances. Flushes and marks are reported right after
the last audio of the utterance they closed. With a seed, utterance k samples with seed + k (modulo 2**63), so the
context's audio depends only on its text, its flush / mark / end points, its voice and its seed. Whatever fails, the
context ends with a `ContextEnd` carrying the typed error. A pronunciation lexicon rewrites the text before the
planner sees it, holding back what the next piece could still change; a flush, mark or end releases it. The text
the planner is given (after the lexicon) is bounded by `max_text_chars` like the client's own text: a lexicon that
expands a context past it stops its text there (the text before it is still spoken to its end: it was accepted), and
the context ends with `TextTooLong`.

A pause closes the utterance being spoken: when no text to say (a letter or a digit) has come for `TEXT_PAUSE_S`
(`CONTENDED_PAUSE_S` while requests wait for an engine slot), the text so far is complete for the engine (as a flush
would make it, with no flush id), so its request finishes and gives its engine slot back; later text starts the next
utterance. A context whose text stops or trickles (and is never ended) would otherwise hold a slot for as long as
its client keeps the session alive, and a few such sessions would hold every slot of the engine. The contended pause
cuts a context's speech in two (its next utterance waits for a slot), so it needs more than a quiet second
(`contended_pause_due`): its listener has played all it was sent (the slot idles for the client's own slow text; an
LLM that stops for a second mid-answer while its listener still has audio keeps its utterance), and the gateway's
loop was not busy (a pause timer that fires late may have text waiting unread behind it: 512 sessions opened at once
held the loop for over a second on an H100, docs/benchmarks.md).
"""
from __future__ import annotations

import asyncio
import copy
import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from engine.errors import EmptyText, RequestError, SynthesisFailed, TextTooLong, VoxgateError, request_failure
from engine.request import SEED_RANGE, AudioChunk, Event, Finished, SynthesisRequest
from engine.serving.async_engine import FrontEnd, RequestHandle
from engine.text.cleanup import speakable
from realtime.audio.formats import MODEL_SAMPLE_RATE
from realtime.lexicon import Lexicon, LexiconStream
from realtime.ws.utterances import Utterance, UtterancePlanner

# seconds without text after which the utterance being spoken closes; an LLM streams tens of tokens a second, so only
# a client whose text has stopped (a stalled LLM, a tool call, a client that never ends its context) waits this long
TEXT_PAUSE_S = 5.0
# ... and while requests wait for an engine slot: a slot held for text that trickles in (a hostile try held every
# slot with a letter a context every 3.5 s) goes to a waiting request; the context speaks on in its next utterance
CONTENDED_PAUSE_S = 1.0
# a pause timer this late says the loop was busy (text may wait unread in the socket): no contended pause then
LATE_TIMER_S = 0.1
# text quiet this long (or the buffering delay, if longer) has its held last words read (`_on_quiet`): long enough
# that an LLM's tokens (tens a second) do not pause inside a word, which would read its halves as two words
SETTLE_AFTER_S = 0.3


def contended_pause_due(quiet_s: float, late_s: float, played_out: bool) -> bool:
    """Whether, while requests wait for a slot, the utterance being spoken closes: no text to say for
    CONTENDED_PAUSE_S, its listener has nothing left to play, and the timer that asks came on time."""
    return quiet_s >= CONTENDED_PAUSE_S and played_out and late_s <= LATE_TIMER_S


@dataclass(frozen=True)
class ContextAudio:
    start_sample: int  # in the context's timeline
    samples: np.ndarray


@dataclass(frozen=True)
class ContextMarker:
    """A flush (name = its flush id) or a mark, after all audio of the text before it; `sample` = its position."""
    kind: str  # "flush" | "mark"
    name: str
    sample: int
    event_id: Any = None  # the client message's that asked for it, echoed on its ack


@dataclass(frozen=True)
class ContextText:
    """Text of utterance `utterance` that went to the engine now, before any audio made from it; `final` once the
    utterance's text is complete. Lets the gateway estimate word times without holding up the audio."""
    utterance: int
    text: str
    final: bool


@dataclass(frozen=True)
class ContextEnd:
    reason: str  # "done" | "error"
    samples: int
    error: VoxgateError | None = None


ContextEvent = ContextAudio | ContextText | ContextMarker | ContextEnd


class SlowReader(VoxgateError):
    """The reader of a context's events took too little of its audio for too long (`ReadAhead.limit_s`)."""


class ShuttingDown(VoxgateError):
    """The server is stopping and the context did not finish within its grace: retry on a server that runs."""


@dataclass(frozen=True)
class ReadAhead:
    """For a reader that takes `events()` at its own pace (an HTTP body, as fast as its client reads it): synthesis
    pauses once `pause_s` of audio waits untaken and resumes once half of it is taken; paused for `limit_s`, the
    context ends with SlowReader, so that a client that reads too little cannot hold an engine slot. (A WebSocket
    session takes every event at once and paces synthesis by its own send queue.)"""
    pause_s: float
    limit_s: float


class SpeechContext:
    def __init__(self, engine: FrontEnd, template: SynthesisRequest, planner: UtterancePlanner,
                 lexicon: Lexicon | None = None, max_text_chars: int | None = None,
                 read_ahead: ReadAhead | None = None) -> None:
        """`template` gives voice, language, sampling and clean-up; its text is ignored. `max_text_chars` bounds the
        text spoken after the lexicon's replacements (None: unbounded). `read_ahead`: how far synthesis may run
        ahead of the reader of `events()` (None: the reader paces it with `pause`)."""
        self.engine = engine
        self.template = template
        self.planner = planner
        self.lexicon = LexiconStream(lexicon) if lexicon is not None else None
        self.max_text_chars = max_text_chars
        self._planned_chars = 0
        self._refused: VoxgateError | None = None  # why the context's own text was stopped (it passed the limit)
        self.samples = 0
        self._events: asyncio.Queue[ContextEvent] = asyncio.Queue()
        self._markers: dict[int, list[tuple[str, str, Any]]] = {}  # utterance index -> markers after its audio
        self._ended = False
        self._paused = False  # the client reads slower than real time: the engine makes no more audio for now
        self.read_ahead = read_ahead
        # called with each chunk's samples as it is queued for `events()`, before its reader takes it: a WebSocket
        # session counts the audio waiting for a slow client from the moment it exists
        self.on_audio: Callable[[int], None] | None = None
        self._untaken = 0  # samples of audio queued for `events()` and not yet taken
        self._slow_reader: asyncio.TimerHandle | None = None  # read_ahead: ends a context paused too long
        self._flushes = 0
        self._wake = asyncio.Event()
        self._request: RequestHandle | None = None  # the speaking utterance's engine request
        self._speaking: Utterance | None = None  # the utterance that request speaks, while it does
        self._timers: dict[int, asyncio.TimerHandle] = {}  # utterance index -> its buffering deadline
        self._pause: asyncio.TimerHandle | None = None  # closes the utterance being spoken if no text comes
        self._quiet: asyncio.TimerHandle | None = None  # due `_settle_after_s` after the last text: it settles
        self._appended_at = 0.0  # the loop's time of the last text of any kind
        self._settle = False  # the text has been quiet for `_settle_after_s`: the engine reads its last words
        self._last_text_at = 0.0  # the loop's time of the last text planned
        self._pause_due = 0.0  # the loop's time the pause timer was set for
        # the loop's time by which a client that plays each chunk as it arrives, after the one before, has played
        # all the audio the context received
        self._played_until = 0.0
        self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def refusal(self) -> VoxgateError | None:
        """The error that stopped the context's own text, if it was stopped (its lexicon's replacements passed
        `max_text_chars`): it takes no more, speaks what came before, and ends with this `TextTooLong`."""
        return self._refused

    def append(self, text: str) -> None:
        if self._refused is not None:
            return  # its error is on its way to the client: later text is dropped, not an error of its own
        if self._ended:
            raise RequestError("text appended after the context ended")
        if self.lexicon is None:
            self._plan(text)
            return
        trial = copy.copy(self.lexicon)  # the lexicon as it would be with this text: kept only if the text fits
        released = trial.append(text)
        if self._fits(released):
            self.lexicon = trial
            self._plan(released)
        else:  # what the lexicon held back of earlier text was accepted: it is spoken, this text is not
            self._plan(self.lexicon.finish())
            self._refuse(self._too_long())

    def _fits(self, text: str) -> bool:
        return self.max_text_chars is None or self._planned_chars + len(text) <= self.max_text_chars

    def _too_long(self) -> TextTooLong:
        return TextTooLong(f"with the lexicon's replacements the text takes more than {self.max_text_chars} "
                           "characters")

    def _plan(self, text: str) -> None:
        if not self._fits(text):
            self._refuse(self._too_long())
            return
        self._planned_chars += len(text)
        loop = asyncio.get_running_loop()
        self.planner.append(text, loop.time())
        self._appended_at, self._settle = loop.time(), False
        if self._quiet is None:  # one timer a context, as the pause's: it looks at the last text's time
            self._quiet_after(self._settle_after_s)
        if speakable(text):  # only text with something to say: spaces alone held a slot for good (a hostile try)
            self._last_text_at = loop.time()
        if self._pause is None:  # one timer a context, not one an append: it looks at the last text's time
            self._pause_after(min(TEXT_PAUSE_S, CONTENDED_PAUSE_S))
        waiting = self.planner.open
        if waiting is not None and not waiting.started and waiting.index not in self._timers:
            # a hair late, so that the planner's clock has passed the delay when the timer wakes it
            self._timers[waiting.index] = loop.call_later(self.planner.max_buffer_delay_s + 0.002, self._wake.set)
        self._wake.set()

    def flush(self, event_id: Any = None) -> str:
        """Close the open utterance; returns the flush id, reported once its audio has gone out."""
        self._flushes += 1
        self._close_with(("flush", str(self._flushes), event_id))
        return str(self._flushes)

    def mark(self, name: str, event_id: Any = None) -> None:
        self._close_with(("mark", name, event_id))

    def end(self) -> None:
        """No more text: finish speaking, then `ContextEnd`."""
        self._release_held()
        self.planner.close()
        self._ended = True
        self._wake.set()

    def pause(self, paused: bool) -> None:
        """Pause synthesis while the client cannot take more audio, or resume it: the speaking utterance's engine
        request pauses (it keeps its slot; its audio comes out the same), and a later one starts paused or not as
        this says."""
        if paused != self._paused:
            self._paused = paused
            if self._request is not None and not self._request.cancelled:
                self.engine.pause(self._request.request_id, paused)

    def cancel(self) -> None:
        """Stop now; nothing more is delivered."""
        self._ended = True
        if self._request is not None:
            self._request.cancel()
        self._task.cancel()
        self._cancel_timers()

    def _cancel_timers(self) -> None:
        for timer in [*self._timers.values(),
                      *(t for t in (self._pause, self._slow_reader, self._quiet) if t is not None)]:
            timer.cancel()

    @property
    def _settle_after_s(self) -> float:
        return max(SETTLE_AFTER_S, self.planner.max_buffer_delay_s)

    def _quiet_after(self, delay_s: float) -> None:
        # a hair after the planner's own timer, so that an utterance that starts then is settled at once
        self._quiet = asyncio.get_running_loop().call_later(delay_s + 0.004, self._on_quiet)

    def _on_quiet(self) -> None:
        """No text for `_settle_after_s`: the utterance being spoken reads its last words now (`_feed`), not when
        more text shows where they end; a client whose text stops mid-sentence hears it at once."""
        quiet_s = asyncio.get_running_loop().time() - self._appended_at
        if quiet_s < self._settle_after_s:
            self._quiet_after(self._settle_after_s - quiet_s)
            return
        self._quiet = None
        self._settle = True
        self._wake.set()

    def _queued_audio(self, samples: int) -> None:
        """Audio for the reader is queued: `on_audio` hears of it; with `read_ahead`, as much as `pause_s` untaken
        pauses synthesis."""
        self._untaken += samples
        if self.on_audio is not None:
            self.on_audio(samples)
        ahead = self.read_ahead
        if ahead is not None and not self._paused and self._untaken >= ahead.pause_s * MODEL_SAMPLE_RATE:
            self.pause(True)
            self._slow_reader = asyncio.get_running_loop().call_later(ahead.limit_s, self._too_slow)

    def _taken(self, samples: int) -> None:
        """`read_ahead`: the reader took audio; under half of `pause_s` untaken resumes synthesis."""
        self._untaken -= samples
        ahead = self.read_ahead
        if ahead is not None and self._paused and self._untaken < ahead.pause_s * MODEL_SAMPLE_RATE / 2:
            self.pause(False)
            if self._slow_reader is not None:
                self._slow_reader.cancel()
                self._slow_reader = None

    def _too_slow(self) -> None:
        self._slow_reader = None
        self.abort(SlowReader(f"the client read too little of its audio for {self.read_ahead.limit_s:g} s"))

    def _on_pause(self) -> None:
        """No text to say for TEXT_PAUSE_S (CONTENDED_PAUSE_S while requests wait for a slot): an utterance that is
        speaking (it holds an engine slot) closes. One not started (buffering, or queued behind one still speaking)
        holds no slot yet. Otherwise it is looked at again, at most CONTENDED_PAUSE_S later (contention may begin)."""
        self._pause = None
        utterance = self.planner.open
        if self._ended or utterance is None:
            return
        now = asyncio.get_running_loop().time()
        if not utterance.started or not self._pause_reached(now):
            # look again when the quiet reaches a pause or the listener runs dry; at least each CONTENDED_PAUSE_S
            quiet_s = now - self._last_text_at
            moments = (CONTENDED_PAUSE_S - quiet_s, TEXT_PAUSE_S - quiet_s, self._played_until - now)
            self._pause_after(min([CONTENDED_PAUSE_S, *(t for t in moments if t > 0)]))
            return
        self._release_held()
        self.planner.close()
        self._wake.set()

    def _pause_reached(self, now: float) -> bool:
        """Whether the quiet closes the utterance being spoken: TEXT_PAUSE_S of it, or the contended pause."""
        quiet_s = now - self._last_text_at
        if quiet_s >= TEXT_PAUSE_S:
            return True
        return self.engine.contended and contended_pause_due(quiet_s, now - self._pause_due,
                                                             played_out=now >= self._played_until)

    def _pause_after(self, delay_s: float) -> None:
        loop = asyncio.get_running_loop()
        self._pause_due = loop.time() + delay_s
        self._pause = loop.call_later(delay_s, self._on_pause)

    def _refuse(self, error: VoxgateError) -> None:
        """Take no more text because the context's own text passed the limit: the text planned before it is spoken
        to its end (a hostile try: cancelling the request cut accepted text off mid-word, or left it unspoken), then
        the context ends with `error`."""
        if self._refused is None and not self._ended and not self._task.done():
            self._refused = error
            self.planner.close()
            self._ended = True
            self._wake.set()

    def finished(self) -> asyncio.Future[None]:
        """Done once the context has ended (every event it will give is queued for `events()`): to wait on
        (`asyncio.wait`, which never cancels it); the context is stopped by `cancel` or `abort`, not through this."""
        return self._task

    def abort(self, error: VoxgateError) -> None:
        """End the context now with `error` (a slow reader, the server stopping): its reader gets the
        audio already delivered, then `ContextEnd("error")`; once: not after it has ended, nor twice in one loop
        turn, before its cancelled task is done."""
        if self._task.done() or self._task.cancelling():
            return
        self.cancel()
        self._events.put_nowait(ContextEnd("error", self.samples, error))

    async def events(self) -> AsyncIterator[ContextEvent]:
        while True:
            event = await self._events.get()
            if isinstance(event, ContextAudio):
                self._taken(len(event.samples))
            yield event
            if isinstance(event, ContextEnd):
                return

    def _release_held(self) -> None:
        """The text's end for the lexicon (a flush, a mark, the end): what it held back is decided now."""
        if self.lexicon is not None and not self._ended:
            self._plan(self.lexicon.finish())

    def _close_with(self, marker: tuple[str, str, Any]) -> None:
        self._release_held()
        if self._refused is not None:  # the text it released passed the limit: its answer is the refusal, no ack
            return
        closed = self.planner.close()
        index = closed.index if closed is not None else len(self.planner.utterances) - 1
        self._markers.setdefault(index, []).append(marker)
        self._wake.set()

    async def _run(self) -> None:
        try:
            error = await self._speak_utterances()
            if self._refused is not None and (error is None or isinstance(error, EmptyText)):
                error = self._refused  # what ended its text is the error, whatever was spoken before
        except Exception as failure:  # a refused submit, a failed engine, a bug: the context ends all the same
            error = request_failure(failure, "speaking the context")
        finally:  # its timers would keep the finished context alive (and wake nothing)
            self._cancel_timers()
        self._events.put_nowait(ContextEnd("error" if error else "done", self.samples, error))

    async def _speak_utterances(self) -> VoxgateError | None:
        """Each utterance in turn, as it starts; the error that ended the context early, if any."""
        index = 0
        while (utterance := await self._next_started(index)) is not None:
            if speakable(utterance.text):  # an utterance of punctuation alone is noise: it is not spoken
                try:
                    error = await self._speak(utterance)
                except EmptyText:  # refused at submit: it cleans to nothing (an emoji, markdown alone)
                    error = None
                if error is not None and not isinstance(error, EmptyText):
                    return error  # an utterance with nothing to say is skipped: the context goes on
            index += 1
        self._emit_markers(index - 1)
        return None if self.samples else EmptyText()

    async def _next_started(self, index: int) -> Utterance | None:
        """Wait until utterance `index` starts speaking (reporting the markers of the one before it meanwhile);
        None once the context has ended without it."""
        while True:
            self._emit_markers(index - 1)
            utterances = self.planner.utterances
            if index < len(utterances):
                self.planner.start_due(asyncio.get_running_loop().time())
                if utterances[index].started:
                    return utterances[index]
            elif self._ended:
                return None
            self._wake.clear()
            await self._wake.wait()

    @property
    def generating(self) -> bool:
        """The engine is making this context's audio with all the text it needs: an utterance whose text is complete
        is being spoken. (One still open may be held, waiting for text: that is the client's silence, and the idle
        timer runs through it.)"""
        speaking = self._speaking
        return speaking is not None and speaking.closed

    async def _speak(self, utterance: Utterance) -> VoxgateError | None:
        """Speak one utterance; the error its request ended with, if any."""
        sampling = self.template.sampling
        if sampling is not None:
            sampling = replace(sampling, seed=(sampling.seed + utterance.index) % SEED_RANGE)
        whole = self.template.layout == "prefill"  # all its text goes into the prompt: it waits for the close
        while whole and not utterance.closed:
            self._wake.clear()
            await self._wake.wait()
        sent = len(utterance.text)
        self._request = request = self.engine.submit(
            replace(self.template, text=utterance.text, sampling=sampling, text_complete=whole))
        if self._paused:
            self.engine.pause(request.request_id, True)
        self._speaking = utterance
        self._events.put_nowait(ContextText(utterance.index, utterance.text, final=whole))
        feeder = None if whole else asyncio.get_running_loop().create_task(
            self._feed(utterance, request.request_id, sent))
        finished = asyncio.get_running_loop().create_future()
        request.listen(functools.partial(self._heard, self.samples, finished))
        try:
            end = await finished
        finally:
            self._speaking = None
            if feeder is not None:
                feeder.cancel()
            if finished.cancelled() or not finished.done() or finished.exception() is not None:
                request.cancel()  # cancelled or failed: its slot goes back, and nothing more is delivered
        return (end.error or SynthesisFailed("synthesis failed")) if end.reason == "error" else None

    def _heard(self, start: int, finished: asyncio.Future[Finished], event: Event) -> None:
        """An event of the utterance's request as it comes (`RequestHandle.listen`): audio is filed for `events()`
        at once, and its `Finished` ends `_speak`'s wait. Raises nothing: a failure here ends the utterance, and what
        comes after it is not filed."""
        if finished.done():
            return
        try:
            if isinstance(event, AudioChunk):
                now = asyncio.get_running_loop().time()
                self._played_until = max(self._played_until, now) + len(event.samples) / MODEL_SAMPLE_RATE
                self._events.put_nowait(ContextAudio(start + event.start_sample, event.samples))
                self._queued_audio(len(event.samples))
                self.samples = max(self.samples, start + event.start_sample + len(event.samples))
            elif isinstance(event, Finished):
                finished.set_result(event)
        except Exception as failure:  # (wrapped: a future refuses some exceptions, StopIteration)
            error = RuntimeError(f"filing the utterance's audio failed: {failure!r}")
            error.__cause__ = failure
            finished.set_exception(error)

    async def _feed(self, utterance: Utterance, request_id: int, sent: int) -> None:
        """Forward the utterance's later text to its request, and its end once it closes."""
        while True:
            if len(utterance.text) > sent or utterance.closed:
                self._events.put_nowait(ContextText(utterance.index, utterance.text[sent:], utterance.closed))
            if len(utterance.text) > sent:
                self.engine.append_text(request_id, utterance.text[sent:])
                sent = len(utterance.text)
            if utterance.closed:
                self.engine.end_text(request_id)
                return
            if self._settle:
                self._settle = False
                self.engine.settle_text(request_id)
            self._wake.clear()
            await self._wake.wait()

    def _emit_markers(self, index: int) -> None:
        for kind, name, event_id in self._markers.pop(index, []):
            self._events.put_nowait(ContextMarker(kind, name, self.samples, event_id))
