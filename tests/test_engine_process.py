"""The engine in a child process behind AsyncEngine's API (tiny model, CPU): exactly the single-request path's audio
(streaming text included), cancel, a refused request, and a child that dies (the gateway starts a new one)."""
import asyncio
import errno
import os
import signal
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from engine.core.engine import EngineConfig
from engine.errors import EmptyText, EngineFailed
from engine.request import AudioChunk, Finished
from engine.serving.audio_ring import AudioRing
from engine.serving.process_engine import EngineSpec, ProcessEngine
from engine.tts import TTSModel
from realtime.gateway import Limits
from tests.gateway_server import running_server
from tests.test_async_engine import collect, request
from voxgate_client.client import VoxgateClient


@pytest.fixture(scope="module")
def tts(tiny_checkpoints) -> TTSModel:
    return TTSModel.load(tiny_checkpoints["custom_voice"])


def spec(tts: TTSModel) -> EngineSpec:
    return EngineSpec(tts.model_dir, "cpu", torch.float32, EngineConfig(max_batch=2, capacity=256))


async def started(tts: TTSModel, steps: list) -> ProcessEngine:
    engine = ProcessEngine(spec(tts), tts, on_step=lambda seconds, batch: steps.append(batch))
    engine.start()
    await engine.ready()
    return engine


def test_requests_and_streaming_text_give_the_single_request_audio(tts):
    whole = request(tts, "Good morning to you all.", 9, 1)
    streamed = request(tts, "And a second voice.", 6, 2)
    steps = []

    async def main():
        engine = await started(tts, steps)
        try:
            first = engine.submit(whole)
            second = engine.submit(replace(streamed, text="And a sec", text_complete=False))
            engine.append_text(second.request_id, "ond voice.")
            engine.end_text(second.request_id)
            results = await asyncio.gather(collect(first), collect(second))
            return results, engine.active
        finally:
            await engine.stop()

    results, active = asyncio.run(main())
    assert active == 0 and steps and max(steps) <= 2
    for (audio, finished), r in zip(results, [whole, streamed]):
        expected = tts.synthesize(r.text, r.voice, language=r.language, sampling=r.sampling, max_frames=r.max_frames,
                                  layout="streaming" if r is streamed else None)
        assert finished.reason != "error" and finished.frames == expected.codes.shape[0]
        np.testing.assert_allclose(audio, expected.audio, atol=1e-5, rtol=0)


def test_without_room_for_the_audio_ring_the_audio_comes_through_the_pipe(tts, monkeypatch):
    """A /dev/shm too small for the ring (a container's 64 MB, full): the engine still serves, its audio whole."""
    def no_room(size: int = 0) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(AudioRing, "create", no_room)
    spoken = request(tts, "Good morning to you all.", 9, 1)

    async def main():
        engine = await started(tts, [])
        try:
            return await collect(engine.submit(spoken))
        finally:
            await engine.stop()

    audio, finished = asyncio.run(main())
    expected = tts.synthesize(spoken.text, spoken.voice, language=spoken.language, sampling=spoken.sampling,
                              max_frames=spoken.max_frames)
    assert finished.reason != "error"
    np.testing.assert_allclose(audio, expected.audio, atol=1e-5, rtol=0)


def test_cancel_a_refused_request_and_a_dead_child(tts):
    async def main():
        engine = await started(tts, [])
        try:
            long = engine.submit(request(tts, "A long sentence that would take many frames.", 150, 3))
            assert isinstance(await anext(aiter(long)), AudioChunk)
            assert long.cancel() and [event async for event in long] == [] and engine.active == 0
            with pytest.raises(EmptyText):  # refused at once, by the parent
                engine.submit(request(tts, "", 5, 4))
            another = engine.submit(request(tts, "Still here after that.", 150, 5))
            await anext(aiter(another))
            os.kill(engine._process.pid, signal.SIGKILL)  # the device fails hard: every request ends
            died = [event async for event in another]
            return died, engine.error
        finally:
            await engine.stop()

    died, error = asyncio.run(main())
    assert isinstance(died[-1], Finished) and died[-1].reason == "error" and died[-1].error is error
    assert isinstance(error, EngineFailed) and str(error) == "the engine process exited"


def test_a_failure_while_the_childs_messages_are_handled_ends_every_request(tts):
    """The child's messages are handled on the event loop: a call there that raises (here the step callback) must
    not leave a request waiting for a `Finished` that was in the same read, nor the engine running."""
    def on_step(seconds: float, batch: int) -> None:
        raise RuntimeError("a metrics bug")

    async def main():
        engine = ProcessEngine(spec(tts), tts, on_step=on_step)
        engine.start()
        await engine.ready()
        try:
            handle = engine.submit(request(tts, "Short.", 10, 6))

            async def events() -> list:
                return [event async for event in handle]
            return await asyncio.wait_for(events(), 30), engine.error
        finally:
            await engine.stop()
            exit_code.append(engine._process.exitcode)

    exit_code: list = []
    events, error = asyncio.run(main())
    assert isinstance(events[-1], Finished) and events[-1].reason == "error" and events[-1].error is error
    assert isinstance(error, EngineFailed) and "RuntimeError: a metrics bug" in str(error)
    assert exit_code == [-signal.SIGKILL]  # killed at once: nothing more it sends is read


def test_the_gateway_serves_through_an_engine_process_and_restarts_it_when_it_dies():
    with running_server(Limits(), engine_process=True) as server:
        async def speak():
            async with VoxgateClient.connect(server.ws) as client:
                return await client.speak("p", ["Hello from ", "another process."])

        result = asyncio.run(speak())
        assert result.done is not None and result.done["audio_ms"] > 0 and result.frames
        first = server.gateway.engine
        os.kill(first._process.pid, signal.SIGKILL)
        reasons = wait_for_ready(server)
        assert any(b"engine process exited" in reason for reason in reasons), reasons
        assert server.gateway.engine is not first and server.gateway.healthy()
        result = asyncio.run(speak())
        assert result.done is not None and result.done["audio_ms"] > 0


def wait_for_ready(server, timeout_s: float = 60) -> list[bytes]:
    """Polls /ready until it answers 200 again; returns the reasons it gave meanwhile (at least one 503)."""
    reasons, deadline = [], time.monotonic() + timeout_s
    while True:
        status, body = server.get("/ready")
        if status == 200 and reasons:
            return reasons
        if status != 200:
            reasons.append(body)
        assert time.monotonic() < deadline, f"/ready did not recover: {reasons[-3:]}"
        time.sleep(0.05)


def test_clone_voices_of_a_base_model_cross_into_the_engine_process(tiny_checkpoints, tmp_path):
    """A Base model's clone prompts (speaker embedding, reference codes) are tensors sent to the child with each
    request; both clone modes speak through it."""
    import soundfile as sf

    from realtime.voices import CloneVoice

    t = np.arange(48000) / 24000
    reference = tmp_path / "ref.wav"
    sf.write(reference, (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32),
             24000)
    clones = (CloneVoice("alice", reference, "Hello there."), CloneVoice("bob", reference))
    with running_server(Limits(), model=tiny_checkpoints["base"], clone_voices=clones, engine_process=True) as server:
        async def speak(voice: str):
            async with VoxgateClient.connect(f"{server.ws}?voice={voice}") as client:
                return await client.speak(voice, ["Cloned ", "speech."])

        for voice in ("alice", "bob"):
            result = asyncio.run(speak(voice))
            assert result.done is not None and result.done["audio_ms"] > 0, result.events
            assert [e["voice"] for e in result.events if e["type"] == "context.started"] == [voice]


def test_a_child_that_cannot_load_and_a_stop_with_requests_open(tts, tmp_path):
    async def bad_model():
        engine = ProcessEngine(EngineSpec(tmp_path / "nothing", "cpu", torch.float32, EngineConfig(max_batch=1)), tts)
        engine.start()
        with pytest.raises(EngineFailed, match="model directory not found"):
            await engine.ready()
        await engine.stop()

    async def stop_while_speaking():
        engine = await started(tts, [])
        long = engine.submit(request(tts, "A long sentence that would take many frames.", 150, 3))
        await anext(aiter(long))
        await engine.stop()
        return [event async for event in long], engine._process.is_alive()

    asyncio.run(bad_model())
    events, alive = asyncio.run(stop_while_speaking())
    assert isinstance(events[-1], Finished) and events[-1].reason == "error" and not alive
