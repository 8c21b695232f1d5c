"""The engine on its own thread, driven from asyncio: concurrent requests get exactly the audio of the
single-request path, and a cancelled request delivers nothing more while the others finish."""
import asyncio

import numpy as np
import pytest

from engine.core.engine import Engine, EngineConfig
from engine.request import AudioChunk, Finished, SynthesisRequest
from engine.sampling import SamplingParams
from engine.serving.async_engine import AsyncEngine
from engine.tts import TTSModel, VoiceRequest


@pytest.fixture(scope="module")
def tts(tiny_checkpoints) -> TTSModel:
    return TTSModel.load(tiny_checkpoints["custom_voice"])


def request(tts: TTSModel, text: str, frames: int, seed: int) -> SynthesisRequest:
    sampling = SamplingParams.from_defaults(tts.config.generation, seed=seed)
    return SynthesisRequest(text, tts.voice(VoiceRequest(speaker="ryan")), language="english", sampling=sampling,
                            max_frames=frames)


async def collect(stream) -> tuple[np.ndarray, Finished]:
    chunks = []
    async for event in stream:
        if isinstance(event, AudioChunk):
            chunks.append(event.samples)
        else:
            return np.concatenate(chunks), event
    raise AssertionError("the stream ended without Finished")


def test_concurrent_requests_equal_the_single_request_path(tts):
    reqs = [request(tts, "Good morning to you all.", 9, 1), request(tts, "And a second voice.", 6, 2)]

    async def main():
        runner = AsyncEngine(Engine(tts, EngineConfig(max_batch=2, capacity=128)))
        runner.start()
        try:
            return await asyncio.gather(*(collect(runner.submit(r)) for r in reqs))
        finally:
            await runner.stop()

    for (audio, finished), r in zip(asyncio.run(main()), reqs):
        expected = tts.synthesize(r.text, r.voice, language=r.language, sampling=r.sampling, max_frames=r.max_frames)
        assert finished.frames == expected.codes.shape[0]
        np.testing.assert_allclose(audio, expected.audio, atol=1e-5, rtol=0)


def test_cancel_stops_delivery_and_frees_the_slot(tts):
    async def main():
        engine = Engine(tts, EngineConfig(max_batch=2, capacity=256))
        runner = AsyncEngine(engine)
        runner.start()
        try:
            long = runner.submit(request(tts, "A long sentence that would take many frames.", 150, 3))
            short = runner.submit(request(tts, "Short one.", 8, 4))
            first = await anext(aiter(long))
            assert isinstance(first, AudioChunk)
            assert long.cancel()
            after = [event async for event in long]
            short_audio, short_finished = await collect(short)
            return after, short_finished, runner.active, len(engine.free_slots)
        finally:
            await runner.stop()

    after, short_finished, active, free = asyncio.run(main())
    assert after == []
    assert short_finished.reason in ("eos", "length")
    assert active == 0 and free == 2


def test_a_listener_gets_the_events_of_async_for_and_one_that_raises_ends_only_its_request(tts):
    """`RequestHandle.listen`: the events come to the listener in order (the audio of the single-request path, then
    Finished), and a listener that raises cancels its own request while the engine and the other requests go on."""
    reqs = [request(tts, "Good morning to you all.", 9, 1), request(tts, "A listener that fails.", 40, 2)]

    async def main():
        runner = AsyncEngine(Engine(tts, EngineConfig(max_batch=2, capacity=128)))
        runner.start()
        try:
            heard, finished = [], asyncio.get_running_loop().create_future()
            good, bad = (runner.submit(r) for r in reqs)
            while good._events.empty():  # events queued before the listener comes are handed over first
                await asyncio.sleep(0.005)
            good.listen(lambda event: heard.append(event) if isinstance(event, AudioChunk)
                        else finished.set_result(event))
            bad.listen(lambda event: 1 / 0)
            end = await asyncio.wait_for(finished, 60)
            return heard, end, bad.cancelled, runner.active, runner.error
        finally:
            await runner.stop()

    heard, end, bad_cancelled, active, error = asyncio.run(main())
    r = reqs[0]
    expected = tts.synthesize(r.text, r.voice, language=r.language, sampling=r.sampling, max_frames=r.max_frames)
    assert end.frames == expected.codes.shape[0]
    assert [chunk.start_sample for chunk in heard] == sorted(chunk.start_sample for chunk in heard)
    np.testing.assert_allclose(np.concatenate([chunk.samples for chunk in heard]), expected.audio, atol=1e-5, rtol=0)
    assert bad_cancelled and active == 0 and error is None
