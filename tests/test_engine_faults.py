"""One request never hurts another (tiny model, CPU, both front ends): whatever stage of a request raises, that
request alone ends with a typed error while a seeded request beside it gets exactly the audio it gets without the
fault; an invalid request is refused at submit; a device fault ends the requests in flight with `EngineFailed`, and
the gateway starts a new engine (or, when that fails too, fails for good). Faults come from `tests/faults.py`."""
import asyncio
import contextlib
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

import realtime.gateway
from engine.core.engine import Engine, EngineConfig
from engine.errors import EmptyText, EngineFailed, EngineFull, RequestError, SynthesisFailed
from engine.prompt import Voice
from engine.request import SEED_RANGE, AudioChunk, Finished, SynthesisRequest
from engine.sampling import SamplingParams
from engine.serving.async_engine import AsyncEngine
from engine.serving.process_engine import EngineSpec, ProcessEngine
from engine.tts import TTSModel, VoiceRequest
from realtime.gateway import Gateway, GatewayOptions
from realtime.ws.speech_context import ContextEnd, ContextText
from tests import faults
from tests.faults import inject_faults
from tests.gateway_server import running_server
from tests.test_engine_process import wait_for_ready
from tests.test_utterances import context_run
from voxgate_client.client import VoxgateClient

CONFIG = EngineConfig(max_batch=2, capacity=256, max_waiting=1)
FRONT_ENDS = ["thread", "process"]


@pytest.fixture(scope="module")
def tts(tiny_checkpoints, one_thread) -> TTSModel:
    return TTSModel.load(tiny_checkpoints["custom_voice"])


def request(tts: TTSModel, text: str, frames: int = 30, complete: bool = True, seed: int = 11) -> SynthesisRequest:
    return SynthesisRequest(text, tts.voice(VoiceRequest(speaker="ryan")), language="english",
                            sampling=SamplingParams.from_defaults(tts.config.generation, seed=seed),
                            max_frames=frames, text_complete=complete)


def good(tts: TTSModel) -> SynthesisRequest:
    return request(tts, "A seeded request that keeps speaking beside the faulty one.")


@contextlib.asynccontextmanager
async def front_end(kind: str, tts: TTSModel, on_failure=None):
    """The engine (with `inject_faults`) behind the thread or the process front end."""
    if kind == "thread":
        engine = Engine(tts, CONFIG)
        inject_faults(engine)
        runner = AsyncEngine(engine, on_failure=on_failure)
        runner.start()
    else:
        runner = ProcessEngine(EngineSpec(tts.model_dir, "cpu", torch.float32, CONFIG, inject_faults), tts,
                               on_failure=on_failure)
        runner.start()
        await runner.ready()
    try:
        yield runner
    finally:
        await runner.stop()


def audio(events) -> np.ndarray:
    return np.concatenate([e.samples for e in events if isinstance(e, AudioChunk)] or [np.zeros(0, np.float32)])


# name -> (the faulty request's first text, text appended to it (None: none), whole text?, the error it ends with)
FAULTS = {
    "tokenizing a whole text": (f"{faults.TOKENIZE} in a whole text.", None, True, SynthesisFailed),
    "tokenizing appended text": ("Words come first, and then ", f"{faults.TOKENIZE} arrives.", False, SynthesisFailed),
    "a lone surrogate appended": ("Words come first, and then ", "a lone \ud800 surrogate.", False, RequestError),
    "building its prompt": (f"{faults.PROMPT} starts this text. ", None, False, SynthesisFailed),
    "prefilling": (f"{faults.PREFILL} starts this text. ", None, False, SynthesisFailed),
    "stepping": (f"{faults.STEP} starts this text. ", None, False, SynthesisFailed),
    "decoding": (f"{faults.DECODE} starts this text. ", None, False, SynthesisFailed),
}


@pytest.mark.parametrize("kind", FRONT_ENDS)
def test_a_request_that_fails_at_any_stage_fails_alone(tts, kind):
    async def beside_good(engine, first: str, more: str | None, complete: bool):
        """The good request, prefilled alone (as without the fault), then the faulty one beside it."""
        good_events = aiter(engine.submit(good(tts)))
        events = [await anext(good_events)]
        faulty = engine.submit(request(tts, first, complete=complete, seed=12))
        if more is not None:
            engine.append_text(faulty.request_id, more)
        if not complete:
            engine.end_text(faulty.request_id)
        faulty_events = [event async for event in faulty]
        good_still_running = engine.active == 1
        return events + [event async for event in good_events], faulty_events, good_still_running

    async def main():
        async with front_end(kind, tts) as engine:
            alone = [event async for event in engine.submit(good(tts))]
            runs = {name: await beside_good(engine, *fault[:3]) for name, fault in FAULTS.items()}
            return alone, runs

    alone, runs = asyncio.run(main())
    assert alone[-1].reason == "length" and len(audio(alone)) > 0
    for name, (good_events, faulty_events, good_still_running) in runs.items():
        end = faulty_events[-1]
        assert end.reason == "error" and type(end.error) is FAULTS[name][3], (name, end)
        assert good_still_running, name
        assert good_events[-1].reason == "length", (name, good_events[-1])
        assert np.array_equal(audio(good_events), audio(alone)), name


def test_a_batched_prefill_that_raises_is_retried_a_request_at_a_time(tts):
    faulty = request(tts, f"{faults.PREFILL} is in this text.", seed=12)
    alone = run_engine(tts, [good(tts)])
    together = run_engine(tts, [good(tts), faulty])
    assert together[1][1].reason == "error" and isinstance(together[1][1].error, SynthesisFailed)
    assert together[0][1].reason == "length" and np.array_equal(together[0][0], alone[0][0])


def test_a_step_that_fails_for_every_request_alone_fails_the_engine(tts):
    with pytest.raises(EngineFailed, match="each of its 2 requests alone"):
        run_engine(tts, [good(tts), request(tts, f"{faults.STEPS_BROKEN} here.", seed=12)])


def run_engine(tts: TTSModel, requests: list[SynthesisRequest]) -> list[tuple[np.ndarray, Finished]]:
    """The requests submitted together to an engine with `inject_faults`, stepped to the end."""
    engine = Engine(tts, replace(CONFIG, max_waiting=len(requests)))
    inject_faults(engine)
    ids = [engine.submit(r) for r in requests]
    events = []
    while not engine.idle():
        events += engine.step()
    return [(audio([e for e in events if e.request_id == i]),
             next(e for e in events if isinstance(e, Finished) and e.request_id == i)) for i in ids]


@pytest.mark.parametrize("kind", FRONT_ENDS)
def test_an_invalid_request_is_refused_at_submit_and_a_full_engine_too(tts, kind):
    base = request(tts, "Valid text.", frames=200)
    sampling = base.sampling
    invalid = {
        "lone surrogate": replace(base, text="a lone \ud800 surrogate"),
        "lone surrogate, streaming": replace(base, text="\udfff", text_complete=False),
        "instruct": replace(base, voice=Voice(speaker="ryan", instruct="calm \ud83d")),
        "seed too large": replace(base, sampling=replace(sampling, seed=SEED_RANGE)),
        "negative seed": replace(base, sampling=replace(sampling, seed=-1)),
        "no frames": replace(base, max_frames=0),
        "unknown language": replace(base, language="klingon"),
        "not a string": replace(base, text=b"bytes"),
    }

    async def main():
        async with front_end(kind, tts) as engine:
            refused = {}
            for name, bad in invalid.items():
                with pytest.raises(RequestError) as failure:
                    engine.submit(bad)
                refused[name] = failure.value
            with pytest.raises(EmptyText):
                engine.submit(replace(base, text="  "))
            open_streams = [engine.submit(base) for _ in range(engine.capacity)]
            with pytest.raises(EngineFull):
                engine.submit(base)
            for stream in open_streams:
                stream.cancel()
            return refused, engine.capacity

    refused, capacity = asyncio.run(main())
    assert capacity == CONFIG.max_batch + CONFIG.max_waiting
    assert "text is not valid Unicode" in str(refused["lone surrogate"])
    assert "instruct is not valid Unicode" in str(refused["instruct"])
    assert "seed" in str(refused["seed too large"]) and "seed" in str(refused["negative seed"])


def test_the_largest_seed_speaks_two_utterances(tts):
    """Utterance 1 samples with seed 2**63 - 1 + 1, which wraps to 0."""
    events = context_run(tts, [("append", "The first utterance. "), ("flush", None), ("append", "And a second."),
                               ("end", None)], seed=SEED_RANGE - 1)
    end = events[-1]
    assert isinstance(end, ContextEnd) and end.reason == "done" and end.samples > 0, end
    assert {e.utterance for e in events if isinstance(e, ContextText)} == {0, 1}


@pytest.mark.parametrize("kind", FRONT_ENDS)
def test_a_device_fault_fails_every_request_in_flight(tts, kind):
    failures = []

    async def main():
        async with front_end(kind, tts, on_failure=failures.append) as engine:
            good_events = aiter(engine.submit(good(tts)))
            await anext(good_events)
            faulty = engine.submit(request(tts, f"{faults.DEVICE} in this text.", seed=12))
            ends = [[event async for event in faulty][-1], [event async for event in good_events][-1]]
            with pytest.raises(EngineFailed):
                engine.submit(good(tts))
            return ends, engine.error

    ends, error = asyncio.run(main())
    assert isinstance(error, EngineFailed) and "AcceleratorError" in str(error) and failures == [error]
    assert all(end.reason == "error" and end.error is error for end in ends)


# --- the gateway: a new engine after a failure, a fatal error when that fails too ----------------------------------

async def speak(server, text: str):
    async with VoxgateClient.connect(server.ws) as client:
        return await client.speak("c", [text])


def test_the_gateway_restarts_an_engine_process_after_a_device_fault():
    with running_server(engine_process=True, engine_setup=inject_faults) as server:
        first = server.gateway.engine
        failed = asyncio.run(speak(server, f"{faults.DEVICE} in this text."))
        assert [e["code"] for e in failed.errors] == ["synthesis_failed"], failed.events
        reasons = wait_for_ready(server)
        assert any(b"AcceleratorError" in reason for reason in reasons), reasons
        assert server.gateway.engine is not first and server.gateway.healthy()
        result = asyncio.run(speak(server, "Speaking again."))
        assert result.done is not None and result.done["audio_ms"] > 0 and not result.errors


def test_a_stalled_step_kills_the_engine_process_and_the_gateway_restarts_it(monkeypatch):
    monkeypatch.setattr(realtime.gateway, "STALLED_STEP_S", 3.0)
    monkeypatch.setattr(realtime.gateway, "WATCHDOG_INTERVAL_S", 0.1)
    with running_server(engine_process=True, engine_setup=inject_faults) as server:
        child = server.gateway.engine._process
        started = time.monotonic()
        failed = asyncio.run(speak(server, f"{faults.STALL} in this text."))
        assert time.monotonic() - started < faults.STALL_S and failed.errors, failed.events
        reasons = wait_for_ready(server)
        assert any(b"stalled" in reason for reason in reasons), reasons
        assert not child.is_alive()
        assert asyncio.run(speak(server, "Speaking again.")).done is not None


class BrokenRestart:
    """An engine setup whose second engine cannot be built."""

    def __init__(self) -> None:
        self.builds = 0

    def __call__(self, engine: Engine) -> None:
        self.builds += 1
        if self.builds > 1:
            raise RuntimeError("no device left")
        inject_faults(engine)


@pytest.mark.parametrize("second_failure", ["the restart fails", "the new engine fails soon"])
def test_the_gateway_fails_for_good_when_a_restart_does_not_help(second_failure):
    setup = BrokenRestart() if second_failure == "the restart fails" else inject_faults
    with running_server(engine_setup=setup) as server:
        fatal = []
        server.gateway.on_fatal = fatal.append
        asyncio.run(speak(server, f"{faults.DEVICE} in this text."))
        if second_failure == "the new engine fails soon":
            wait_for_ready(server)
            asyncio.run(speak(server, f"{faults.DEVICE} in this text."))
        deadline = time.monotonic() + 60
        while not fatal and time.monotonic() < deadline:
            time.sleep(0.05)
        ready, reason = server.gateway.readiness()
        assert len(fatal) == 1 and not server.gateway.healthy() and not ready and reason == fatal[0]
        expected = "no device left" if second_failure == "the restart fails" else "failed again within 60 s"
        assert expected in reason and server.get("/ready")[0] == 503


def test_a_start_up_failure_is_fatal():
    gateway = Gateway(GatewayOptions(engine_setup=_broken_setup))
    fatal = []
    gateway.on_fatal = fatal.append

    async def main():
        await gateway.start()
        await gateway.stop()

    asyncio.run(main())
    assert len(fatal) == 1 and "start-up failed: RuntimeError: no device" in fatal[0]
    assert not gateway.healthy() and gateway.readiness() == (False, fatal[0])


def _broken_setup(engine: Engine) -> None:
    raise RuntimeError("no device")
