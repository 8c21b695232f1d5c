"""The Pipecat plugin (voxgate_client.pipecat) driven by Pipecat's own pipeline classes against a real server (tiny
model, CPU): the audio frames' rate and count are the server's, sentences are joined as spoken text, word timestamps
come out as Pipecat's word frames, an interruption leaves no audio after it, and keepalives hold an idle socket."""
from __future__ import annotations

import asyncio
import json
import unicodedata
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pipecat.frames.frames import (
    EndFrame,
    Frame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
    TTSUpdateSettingsFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TextAggregationMode
from pipecat.utils.errors import ErrorCategory
from pipecat.workers.runner import WorkerRunner

from realtime.gateway import Limits
from tests.gateway_server import running_server, short_speech_server
from voxgate_client.client import VoxgateClient
from voxgate_client.pipecat import VoxgateTTSService, join_sentence

SEED = {"seed": 11}
LONG_REPLY = " ".join(f"Sentence number {i} goes on for a while, so that speaking it takes time." for i in range(12))

@pytest.fixture(scope="module")
def server(one_thread):
    with short_speech_server() as running:
        yield running


class Recorder(FrameProcessor):
    """The end of the pipeline: every downstream frame, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[Frame] = []
        self.audio = asyncio.Event()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction == FrameDirection.DOWNSTREAM:
            self.frames.append(frame)
            if isinstance(frame, TTSAudioRawFrame):
                self.audio.set()
        await self.push_frame(frame, direction)


class Run:
    """A Pipecat pipeline [tts, recorder] running while the test feeds it frames; `finished` collects the server's
    closing event of each context (the plugin's `on_context_finished`)."""

    def __init__(self, tts: VoxgateTTSService, sample_rate: int) -> None:
        self.tts, self.recorder = tts, Recorder()
        self.finished: dict[str, dict[str, Any]] = {}
        self.connections = 0
        tts.add_event_handler("on_context_finished", self._finished)
        tts.add_event_handler("on_connected", self._connected)
        self.worker = PipelineWorker(Pipeline([tts, self.recorder]), cancel_on_idle_timeout=False,
                                     params=PipelineParams(audio_out_sample_rate=sample_rate))
        self.runner = WorkerRunner(handle_sigint=False)

    async def _finished(self, tts, context_id: str, event: dict[str, Any]) -> None:
        self.finished[context_id] = event

    async def _connected(self, tts) -> None:
        self.connections += 1

    async def __aenter__(self) -> Run:
        started = asyncio.Event()
        self.worker.add_event_handler("on_pipeline_started", lambda *_: started.set())
        await self.runner.add_workers(self.worker)
        self.task = asyncio.create_task(self.runner.run())
        await asyncio.wait_for(started.wait(), 30)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.worker.queue_frame(EndFrame())
        await asyncio.wait_for(self.task, 60)

    async def turn(self, *pieces: str) -> None:
        await self.worker.queue_frames([LLMFullResponseStartFrame(), *map(LLMTextFrame, pieces),
                                        LLMFullResponseEndFrame()])

    async def until_finished(self, count: int) -> None:
        while len(self.finished) < count:
            await asyncio.sleep(0.02)

    def of(self, kind: type) -> list[Frame]:
        return [f for f in self.recorder.frames if isinstance(f, kind)]


async def reference_pcm(server, pieces: list[str], sample_rate: int, flush: bool, voice: str | None = None) -> bytes:
    """The same text, voice and seed through the plain client: the audio the plugin must have passed on."""
    async with VoxgateClient.connect(server.ws, encoding="pcm_s16le", sample_rate=sample_rate) as client:
        await client.start(sampling=SEED, voice=voice)
        result = await client.speak("reference", pieces, flush=flush)
    assert result.done is not None and not result.errors
    return b"".join(f.payload for f in result.frames)


def test_a_sentence_turn_is_the_servers_audio_at_the_pipeline_rate_with_its_words(server):
    async def go():
        tts = VoxgateTTSService(url=server.ws, sampling=SEED)
        async with Run(tts, 16000) as run:
            await run.turn("Sure", "! The weather", " is fine today.")
            await asyncio.wait_for(run.until_finished(1), 60)
        return run, await reference_pcm(server, ["Sure!", " The weather is fine today."], 16000, flush=True)

    run, reference = asyncio.run(go())
    (context_id, done), = run.finished.items()
    audio = run.of(TTSAudioRawFrame)
    assert done["type"] == "context.done" and {f.context_id for f in audio} == {context_id}
    assert {f.sample_rate for f in audio} == {16000} and {f.num_channels for f in audio} == {1}
    pcm = b"".join(f.audio for f in audio)
    assert len(pcm) // 2 == round(done["audio_ms"] * 16) and pcm == reference
    assert [f.text for f in run.of(TTSTextFrame)] == ["Sure!", "The", "weather", "is", "fine", "today."]
    assert len(run.of(TTSStartedFrame)) == 1 and len(run.of(TTSStoppedFrame)) == 1
    kinds = [type(f) for f in run.recorder.frames if isinstance(f, (TTSStartedFrame, TTSAudioRawFrame,
                                                                    TTSStoppedFrame))]
    assert kinds[0] is TTSStartedFrame and kinds[-1] is TTSStoppedFrame


def test_word_frames_follow_the_servers_timestamps(server):
    """Pipecat times a word frame from its first audio by the server's `start`: the pts grow with the words."""
    async def go():
        tts = VoxgateTTSService(url=server.ws, sampling=SEED)
        async with Run(tts, 24000) as run:
            await run.turn("One two three. ", "Four five six.")
            await asyncio.wait_for(run.until_finished(1), 60)
        return run

    run = asyncio.run(go())
    words = run.of(TTSTextFrame)
    assert [w.text for w in words] == ["One", "two", "three.", "Four", "five", "six."]
    pts = [w.pts for w in words]
    assert all(p is not None for p in pts) and pts == sorted(pts) and pts[-1] > pts[0]


def test_token_streaming_sends_tokens_verbatim_and_ends_the_turn(server):
    pieces = ["Hel", "lo there", ", how are", " you?"]

    async def go():
        tts = VoxgateTTSService(url=server.ws, sampling=SEED, text_aggregation_mode=TextAggregationMode.TOKEN)
        async with Run(tts, 24000) as run:
            await run.turn(*pieces)
            await asyncio.wait_for(run.until_finished(1), 60)
        return run, await reference_pcm(server, pieces, 24000, flush=False)

    run, reference = asyncio.run(go())
    (done,) = run.finished.values()
    pcm = b"".join(f.audio for f in run.of(TTSAudioRawFrame))
    assert done["type"] == "context.done" and pcm == reference
    assert {f.sample_rate for f in run.of(TTSAudioRawFrame)} == {24000}


def test_a_voice_update_speaks_from_the_next_turn(server):
    voices = json.loads(server.get("/v1/voices")[1])
    other = next(v["id"] for v in voices["voices"] if v["id"] != voices["default"])

    async def go():
        tts = VoxgateTTSService(url=server.ws, sampling=SEED)
        async with Run(tts, 24000) as run:
            await run.turn("First turn.")
            await asyncio.wait_for(run.until_finished(1), 60)
            await run.worker.queue_frame(TTSUpdateSettingsFrame(delta=TTSSettings(voice=other)))
            await run.turn("Second turn.")
            await asyncio.wait_for(run.until_finished(2), 60)
        return run, await reference_pcm(server, ["Second turn."], 24000, flush=True, voice=other)

    run, reference = asyncio.run(go())
    second = list(run.finished)[1]
    assert b"".join(f.audio for f in run.of(TTSAudioRawFrame) if f.context_id == second) == reference


def test_an_interruption_cancels_the_context_and_no_audio_follows_it(server):
    async def go():
        tts = VoxgateTTSService(url=server.ws)
        async with Run(tts, 24000) as run:
            await run.turn(LONG_REPLY)
            await asyncio.wait_for(run.recorder.audio.wait(), 60)
            await run.worker.queue_frame(InterruptionFrame())
            await asyncio.wait_for(run.until_finished(1), 30)
            await asyncio.sleep(0.5)  # anything still on the way would arrive now
            await run.worker.queue_frame(TTSSpeakFrame("And now for something else."))
            await asyncio.wait_for(run.until_finished(2), 60)
        return run

    run = asyncio.run(go())
    (first, cancelled), (second, done) = run.finished.items()
    assert cancelled["type"] == "context.cancelled" and cancelled["reason"] == "client"
    assert done["type"] == "context.done"
    frames = run.recorder.frames
    interrupted_at = next(i for i, f in enumerate(frames) if isinstance(f, InterruptionFrame))
    after = [f for f in frames[interrupted_at:] if isinstance(f, TTSAudioRawFrame)]
    before = [f for f in frames[:interrupted_at] if isinstance(f, TTSAudioRawFrame)]
    assert before and all(f.context_id == first for f in before)
    assert after and all(f.context_id == second for f in after)  # the next turn speaks; the cancelled one never
    assert sum(len(f.audio) for f in before) // 2 <= round(cancelled["audio_sent_ms"] * 24)


def test_keepalives_hold_an_idle_socket_past_the_idle_timeout(server):
    """The server closes a session idle for 1 s here; the plugin's keepalives (every 0.25 s) keep it."""
    async def go():
        tts = VoxgateTTSService(url=server.ws)
        async with Run(tts, 24000) as run:
            await asyncio.sleep(2.5)
            await run.turn("Still here.")
            await asyncio.wait_for(run.until_finished(1), 60)
        return run

    run = asyncio.run(go())
    assert run.connections == 1 and [e["type"] for e in run.finished.values()] == ["context.done"]
    assert run.of(TTSAudioRawFrame)


def test_a_voice_the_server_refuses_is_a_connection_error(server):
    async def go():
        tts = VoxgateTTSService(url=server.ws, voice="no-such-voice")
        errors = []
        tts.add_event_handler("on_connection_error", lambda _, error: errors.append(error))
        async with Run(tts, 24000):
            pass
        return errors

    (error,) = asyncio.run(go())
    assert error.startswith("invalid_config:") and "no-such-voice" in error


def test_text_the_server_refuses_ends_its_turn_with_the_code_and_the_next_turn_speaks(server):
    """A lone surrogate (broken LLM output) is refused on the turn's first append: the error names its code, the
    turn's audio context ends, and the service goes on."""
    async def go():
        tts = VoxgateTTSService(url=server.ws)
        errors = []
        tts.add_event_handler("on_error", lambda _, frame: errors.append(frame))
        async with Run(tts, 24000) as run:
            await run.worker.queue_frame(TTSSpeakFrame("Broken \ud800 text."))
            await run.turn("Fine text.")
            await asyncio.wait_for(run.until_finished(1), 60)
        return run, errors

    run, errors = asyncio.run(go())
    assert any(error.error.startswith("voxgate error invalid_message") for error in errors), errors
    # one turn's refused text is the application's: not a lasting fault of the service, which stays usable
    ours = [error for error in errors if error.error.startswith("voxgate")]  # Pipecat adds "no audio" of its own
    assert {error.category for error in ours} == {ErrorCategory.APPLICATION} and run.tts.is_usable
    (context_id, done), = run.finished.items()
    assert done["type"] == "context.done" and {f.context_id for f in run.of(TTSAudioRawFrame)} == {context_id}
    assert len(run.of(TTSStoppedFrame)) == 2  # the refused turn's and the spoken one's


def test_three_refused_turns_in_a_row_leave_the_service_usable(server):
    """Hostile try 12: three turns in a row refused for their text (emoji only, a lone surrogate) made Pipecat count
    three contexts with no audio and write the service off, so later turns went unspoken; and each refused turn's
    `context.end` drew a stray context_not_found. The next turn speaks, the service stays usable, and only the
    refusals' own codes are reported."""
    async def go():
        tts = VoxgateTTSService(url=server.ws)
        errors = []
        tts.add_event_handler("on_error", lambda _, frame: errors.append(frame))
        async with Run(tts, 24000) as run:
            for text in ("\U0001f600\U0001f389", "Broken \ud800 text.", "\U0001f600"):
                await run.worker.queue_frame(TTSSpeakFrame(text))
            await run.turn("Fine text.")
            await asyncio.wait_for(run.until_finished(3), 60)  # the emoji turns' contexts end too (empty_text)
            await asyncio.sleep(0.5)  # a stray error would come right after
        return run, errors

    run, errors = asyncio.run(go())
    codes = [error.error.split()[2] for error in errors if error.error.startswith("voxgate error")]
    assert sorted(codes) == ["empty_text:", "empty_text:", "invalid_message:"], errors
    assert run.tts.is_usable and not any(error.fatal for error in errors), errors
    spoken = {f.context_id for f in run.of(TTSAudioRawFrame)}
    assert len(spoken) == 1 and run.finished[spoken.pop()]["type"] == "context.done"


def test_a_burst_of_tokens_is_spoken_whole_and_ends_its_turn():
    """Hostile try 12: a turn's tokens went as one append each; past the server's message rate the rest of the text
    and the turn's context.end were dropped, so no turn ended and each held a context until the session's limit.
    Against a server allowing 20 messages a second (bursts of 40), a turn of 200 tokens at once: the audio of its
    whole text, and the turn ends."""
    pieces = ["Hello"] + [f" w{i}" for i in range(199)]

    async def go(server):
        tts = VoxgateTTSService(url=server.ws, sampling=SEED, text_aggregation_mode=TextAggregationMode.TOKEN)
        async with Run(tts, 24000) as run:
            await run.turn(*pieces)
            await asyncio.wait_for(run.until_finished(1), 120)
        return run, await reference_pcm(server, ["".join(pieces)], 24000, flush=False)

    with running_server(Limits(max_message_rate=20.0), synthetic_frames_per_token=1.0) as server:
        run, reference = asyncio.run(go(server))
    (done,) = run.finished.values()
    assert done["type"] == "context.done"
    assert b"".join(f.audio for f in run.of(TTSAudioRawFrame)) == reference


def test_a_rate_the_server_does_not_send_is_refused_before_connecting(server):
    """Pipecat turns a failed setup into an unusable service and an error naming the cause."""
    async def go():
        tts = VoxgateTTSService(url=server.ws)
        errors = []
        tts.add_event_handler("on_error", lambda _, frame: errors.append(frame.error))
        async with Run(tts, 11025) as run:
            pass
        return tts, run, errors

    tts, run, errors = asyncio.run(go())
    assert not tts.is_usable and run.connections == 0
    assert any("not 11025" in error for error in errors), errors


@given(st.lists(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1), min_size=1))
def test_joined_sentences_keep_every_word_apart(sentences):
    """However Pipecat cut the text, the words sent are the sentences' words, none glued to the next sentence's
    (CJK sentences excepted: they have no spaces to keep)."""
    sent = ""
    for sentence in sentences:
        sent += join_sentence(sent, sentence)
    assert sent.replace(" ", "") == "".join(sentences).replace(" ", "")
    if not any(unicodedata.east_asian_width(s[-1]) in ("W", "F") for s in sentences[:-1]):
        assert sent.split() == [word for s in sentences for word in s.split()]


def test_sentences_are_joined_as_text_is_written():
    assert join_sentence("", "Sure!") == "Sure!" and join_sentence("Sure!", "The") == " The"
    assert join_sentence("Sure! ", "The") == "The" and join_sentence("Sure!", " The") == " The"
    assert join_sentence("你好。", "今天很好。") == "今天很好。"


def test_a_wrong_key_is_an_authentication_error_that_leaves_the_service_unusable():
    """Pipecat treats an authentication error as lasting (no reconnect loop, a service switcher fails over): the
    server's refusal, which comes after the socket opened (close 4001), must be classified as one."""
    async def go():
        with running_server(Limits(api_keys=("k",))) as keyed:
            tts = VoxgateTTSService(url=keyed.ws, api_key="wrong")
            errors = []
            tts.add_event_handler("on_error", lambda _, frame: errors.append(frame))
            async with Run(tts, 24000):
                await asyncio.sleep(0.5)
            return tts, errors

    tts, errors = asyncio.run(go())
    assert errors and errors[0].category == ErrorCategory.AUTHENTICATION and "unauthorized" in errors[0].error
    assert not tts.is_usable


def test_chinese_words_carry_their_own_spacing_and_punctuation(server):
    """Pipecat rebuilds the turn's text from the word frames, with spaces between them unless a frame carries its
    own: the CJK words (a character and its punctuation) say they do, so the text stays as written."""
    async def go():
        async with Run(VoxgateTTSService(url=server.ws), 24000) as run:
            await run.turn("你好。今天天气很好。")
            await asyncio.wait_for(run.until_finished(1), 60)
        return run

    words = [frame for frame in asyncio.run(go()).of(TTSTextFrame)]
    assert "".join(word.text for word in words) == "你好。今天天气很好。"
    assert all(word.includes_inter_frame_spaces for word in words)


def test_a_turn_that_dialed_during_a_reconnect_keeps_its_socket(server):
    """Pipecat's reconnect loop waits out a backoff between attempts; a turn in that gap dials a socket itself. The
    next attempt must keep that socket (and the turn's context on it) rather than close it to dial again."""
    async def go():
        tts = VoxgateTTSService(url=server.ws)
        async with Run(tts, 24000):
            dialed = tts._websocket
            kept = await tts._reconnect_websocket(1)
            return dialed, kept, tts._websocket

    dialed, kept, after = asyncio.run(go())
    assert dialed is not None and kept and after is dialed


def test_an_interruption_right_after_a_short_turn_is_sent_still_cancels_it(server):
    """A turn whose text went out with its end (`context.end`), interrupted at once, before the server's
    `context.started` came back: the plugin knew the context in neither of its sets, and the server spoke it all for
    nobody (a compatibility review's finding: 16 s of audio, an engine slot held). The cancel goes out regardless."""
    async def go():
        tts = VoxgateTTSService(url=server.ws)
        ended = asyncio.Event()
        send = tts._send

        async def noting_the_end(type_: str, **fields: Any) -> None:
            await send(type_, **fields)
            if type_ == "context.end":
                ended.set()

        tts._send = noting_the_end
        # the server's context.started comes back only after the interruption (a slow network, made certain here)
        interrupted = asyncio.Event()
        on_event, on_interrupted = tts._on_event, tts.on_audio_context_interrupted

        async def started_late(event: dict[str, Any]) -> None:
            if event.get("type") == "context.started":
                await asyncio.wait_for(interrupted.wait(), 30)
            await on_event(event)

        async def noting_the_interruption(context_id: str) -> None:
            await on_interrupted(context_id)
            interrupted.set()

        tts._on_event, tts.on_audio_context_interrupted = started_late, noting_the_interruption
        async with Run(tts, 24000) as run:
            await run.worker.queue_frame(TTSSpeakFrame(LONG_REPLY))
            await asyncio.wait_for(ended.wait(), 30)
            await run.worker.queue_frame(InterruptionFrame())
            await asyncio.wait_for(run.until_finished(1), 30)
        return run

    (closing,) = asyncio.run(go()).finished.values()
    assert closing["type"] == "context.cancelled" and closing["reason"] == "client", closing
