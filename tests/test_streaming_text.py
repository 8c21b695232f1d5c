"""Requests whose text arrives in pieces: the same audio as the whole text (with a seed), however the text was split
and whenever it arrived; a stream holds while its next text is missing; errors and cancels."""
import asyncio
import random

import numpy as np
import pytest

from engine.core.engine import Engine, EngineConfig
from engine.errors import EmptyText
from engine.request import AudioChunk, Finished, SynthesisRequest
from engine.sampling import SamplingParams
from engine.serving.async_engine import AsyncEngine
from engine.tts import TTSModel, VoiceRequest

TEXT = "Hello there, it's 3.14 o'clock! 你好，世界。Fine."


@pytest.fixture(scope="module")
def tts(tiny_checkpoints) -> TTSModel:
    return TTSModel.load(tiny_checkpoints["custom_voice"])


def streaming(tts: TTSModel, first: str, seed: int = 7, frames: int | None = None) -> SynthesisRequest:
    return SynthesisRequest(first, tts.voice(VoiceRequest(speaker="ryan")), language="english",
                            sampling=SamplingParams.from_defaults(tts.config.generation, seed=seed),
                            max_frames=frames, text_complete=False)


def pieces(text: str, how: str, rng: random.Random) -> list[str]:
    if how == "chars":
        return list(text)
    if how == "words":
        return [w for w in text.replace(" ", " \0").split("\0") if w]
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def run_streaming(engine: Engine, requests: list[SynthesisRequest], parts: list[list[str]], rng: random.Random,
                  max_frames_between: int = 3):
    """Feed each request its pieces at random steps (0 to a few frames apart); returns audio and Finished."""
    ids = [engine.submit(r) for r in requests]
    left = [list(p) for p in parts]
    audio = {i: [] for i in ids}
    finished = {}
    for _ in range(2000):
        for request_id, rest in zip(ids, left):
            if rest and rng.random() < 1 / max_frames_between:
                engine.append_text(request_id, rest.pop(0))
                if not rest:
                    engine.end_text(request_id)
        for event in engine.step():
            if isinstance(event, AudioChunk):
                assert event.start_sample == sum(len(c) for c in audio[event.request_id])
                audio[event.request_id].append(event.samples)
            else:
                finished[event.request_id] = event
        if len(finished) == len(ids):
            break
    return [(np.concatenate(audio[i]) if audio[i] else np.zeros(0, np.float32), finished[i]) for i in ids]


@pytest.mark.parametrize("how", ["chars", "words", "random"])
def test_split_text_gives_the_whole_texts_audio(tts, how):
    rng = random.Random(how)
    request = streaming(tts, "")
    expected = tts.synthesize(TEXT, request.voice, language="english", layout="streaming",
                              sampling=request.sampling)
    other = streaming(tts, "", seed=9)  # a second request in the batch, with its own timing
    engine = Engine(tts, EngineConfig(max_batch=2, capacity=256))
    (audio, finished), _ = run_streaming(engine, [request, other], [pieces(TEXT, how, rng), ["Another one."]], rng)
    assert finished.reason in ("eos", "length") and finished.frames == expected.codes.shape[0]
    np.testing.assert_allclose(audio, expected.audio, atol=1e-5, rtol=0)
    # PROTOCOL.md: identical fp32 audio however the text was split and whenever it came (held frames are decoded at
    # once, so the decoder's chunks follow the text's timing), against the whole text at once
    (whole, _), = run_streaming(Engine(tts, EngineConfig(max_batch=2, capacity=256)), [streaming(tts, "")], [[TEXT]],
                                rng, max_frames_between=1)
    assert np.array_equal(audio, whole)


def test_a_stream_holds_while_its_text_is_missing(tts):
    engine = Engine(tts, EngineConfig(max_batch=1, capacity=256, chunk_frames=4))
    request_id = engine.submit(streaming(tts, "One two three four five six seven "))
    produced = []
    for _ in range(20):  # driven as the AsyncEngine drives it: a step only while one would do something
        if engine.has_work():
            produced += [e for e in engine.step() if isinstance(e, AudioChunk)]
    stream = engine.running[request_id]
    frames = stream.frames
    assert 0 < frames < 10 and stream.text_id() is None  # it ran through the text it had, then held
    assert sum(len(c.samples) for c in produced) == frames * tts.decoder.samples_per_frame  # held audio flushed
    assert not engine.has_work()
    for _ in range(5):
        assert engine.step() == []
    assert engine.running[request_id].frames == frames  # no padding-driven frames while held
    engine.append_text(request_id, "eight nine.")
    engine.end_text(request_id)
    assert engine.has_work()
    while not engine.idle():
        engine.step()
    assert engine.free_slots == [0]


def test_empty_streaming_text_fails_alone(tts):
    engine = Engine(tts, EngineConfig(max_batch=2, capacity=256))
    empty = engine.submit(streaming(tts, "  "))
    good = engine.submit(streaming(tts, "Fine.", frames=4))
    engine.end_text(empty)
    engine.end_text(good)
    finished = {}
    while not engine.idle():
        finished.update({e.request_id: e for e in engine.step() if isinstance(e, Finished)})
    assert finished[empty].reason == "error" and isinstance(finished[empty].error, EmptyText)
    assert finished[good].reason == "length" and finished[good].frames == 4


def test_appending_to_an_ended_or_unknown_request_is_refused(tts):
    from engine.errors import RequestError

    engine = Engine(tts, EngineConfig(max_batch=1, capacity=256))
    request_id = engine.submit(streaming(tts, "Hi."))
    engine.end_text(request_id)
    with pytest.raises(RequestError, match="after its end"):
        engine.append_text(request_id, "more")
    with pytest.raises(RequestError, match="not a running request"):
        engine.append_text(999, "x")


def test_async_engine_streams_text_and_cancel_frees_the_slot(tts):
    async def main():
        engine = Engine(tts, EngineConfig(max_batch=1, capacity=256))
        runner = AsyncEngine(engine)
        runner.start()
        try:
            first = runner.submit(streaming(tts, "Streaming text ", frames=40))
            for word in ("arrives ", "word ", "by ", "word."):
                runner.append_text(first.request_id, word)
                await asyncio.sleep(0.01)
            chunk = await anext(aiter(first))
            assert isinstance(chunk, AudioChunk)
            first.cancel()
            second = runner.submit(streaming(tts, "Next.", frames=3))  # gets the freed slot
            runner.end_text(second.request_id)
            events = [event async for event in second]
            return events, engine.free_slots
        finally:
            await runner.stop()

    events, free = asyncio.run(main())
    assert isinstance(events[-1], Finished) and events[-1].frames == 3
    assert free == [0]
