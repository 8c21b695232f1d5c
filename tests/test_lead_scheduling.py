"""Scheduling for smoothness: the lead-driven chunk schedule and the admission that protects running streams. On the
simulator they keep buffers from running dry; in the engine they change when audio comes out, never what it is."""
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.core.decoding import LEAD_MARGIN, first_chunk, later_chunk_lengths, lead_chunk, lead_chunk_lengths
from engine.core.engine import Engine, EngineConfig
from engine.core.scheduler import FRAME_SECONDS, MAX_ADMISSION_WAIT_S, Scheduler
from engine.core.simulator import Arrival, CostModel, poisson_workload, simulate
from engine.request import AudioChunk, Finished, SynthesisRequest
from engine.sampling import SamplingParams
from engine.tts import TTSModel, VoiceRequest


def test_lead_chunks_start_at_one_frame_and_grow_with_the_lead():
    assert lead_chunk(0, 10.0, 1, 4) == 1  # time to first audio, whatever the lead
    assert lead_chunk(1, 0.05, 1, 4) == 1  # under a frame of audio ahead: every frame goes at once
    assert lead_chunk(6, -0.3, 1, 4) == 1  # already late
    assert lead_chunk(3, 2 * FRAME_SECONDS * LEAD_MARGIN, 1, 4) == 2
    assert lead_chunk(9, 5.0, 1, 4) == 4  # a deep buffer: the largest chunk
    assert lead_chunk_lengths(1, 4) == (1, 2, 4) and lead_chunk_lengths(2, 6) == (1, 2, 4, 6)


@given(decoded=st.integers(0, 10_000), lead=st.floats(-60.0, 60.0), more=st.floats(0.0, 60.0),
       first=st.integers(1, 8), largest=st.integers(1, 16))
def test_lead_chunk_properties(decoded, lead, more, first, largest):
    """A length with a decoder graph; the first chunk is `first_chunk_frames`; later ones are at most `chunk_frames`,
    fit into the lead (or are a single frame), are the longest of the later lengths that do (the first chunk's length
    is not one of them unless it is also a power of two or `chunk_frames`), and never shrink as the lead grows."""
    n = lead_chunk(decoded, lead, first, largest)
    assert n in lead_chunk_lengths(first, largest)
    if decoded == 0:
        assert n == first
        return
    fits = lead / (LEAD_MARGIN * FRAME_SECONDS)
    assert 1 <= n <= largest and (n == 1 or n <= fits)
    assert n in later_chunk_lengths(largest)
    longer = [m for m in later_chunk_lengths(largest) if n < m]
    assert not longer or min(longer) > fits
    assert lead_chunk(decoded, lead + more, first, largest) >= n


@given(first=st.integers(1, 4), batch=st.integers(0, 600), busy=st.none() | st.integers(0, 600),
       interactive=st.booleans())
def test_a_busy_step_starts_a_one_shot_stream_with_one_frame_more(first, batch, busy, interactive):
    longer = busy is not None and batch > busy and not interactive
    assert first_chunk(first, batch, busy, interactive) == first + longer


def first_slack(request) -> float:
    """Seconds between the arrival of a request's second chunk and the end of its first one's audio (a client
    playing from its first audio may stall that long without running dry)."""
    n = request.delivered.count(request.delivered[0])
    return request.delivered[0] + n * FRAME_SECONDS - request.delivered[n]


def test_a_busy_engine_gives_each_new_stream_a_frame_of_slack_more_for_about_a_step_of_latency():
    """Poisson load of one-shot requests on the simulator, each in a step of more than `busy_batch` requests: a
    one-frame start leaves under 80 ms to read the next chunk in, a two-frame start over 80 ms; first audio is later
    by a step or two on average (the second frame, and the decode of a two-frame chunk). Interactive requests keep
    the one-frame start."""
    arrivals = [replace(a, interactive=False) for a in poisson_workload(20, 6, seed=4) if a.frames > 3]

    def run(busy: int | None, arrivals=arrivals):
        requests = simulate(arrivals, Scheduler(256), CostModel(), chunks="lead", busy_batch=busy)
        return sorted(requests, key=lambda r: r.request_id)

    light, busy = run(None), run(0)
    assert all(first_slack(r) < FRAME_SECONDS for r in light)
    assert all(first_slack(r) > FRAME_SECONDS for r in busy)
    conversations = run(0, [replace(a, interactive=True) for a in arrivals])
    assert [r.delivered for r in conversations] == [r.delivered for r in light]
    later = np.mean([after.delivered[0] - before.delivered[0] for before, after in zip(light, busy)])
    assert 0 < later < 2 * CostModel().frame_seconds(256, 0) + 0.01
    assert run(10_000)[0].delivered == light[0].delivered  # never busy: the one-frame start


def test_unknown_options_are_refused():
    with pytest.raises(ValueError, match="unknown admission 'greedy'"):
        Scheduler(1, admission="greedy")
    with pytest.raises(ValueError, match="unknown chunk schedule 'big'"):
        simulate([Arrival(0.0, 3)], Scheduler(1), chunks="big")


class RecordingScheduler(Scheduler):
    """Notes the virtual time of each step's admission: when a request could first be seen ready, and admitted."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[float] = []

    def admit(self, prepare):
        self.steps.append(self.clock())
        return super().admit(prepare)


def burst(requests: int) -> list[Arrival]:
    """One long stream, then a burst arriving just as its first frame (80 ms of audio) is out."""
    return [Arrival(0.0, 100)] + [Arrival(0.017, 30) for _ in range(requests)]


@pytest.mark.parametrize("chunks", [None, "lead"])
def test_protect_keeps_a_running_buffer_from_emptying_where_admitting_all_does_not(chunks):
    """Admitting 100 at once makes a step longer than the first stream's 80 ms lead; `protect` prefills them in
    batches that its lead (and then theirs) can pay for, so no stream runs dry, and none waits past the bound."""
    def run(admission: str):
        scheduler = RecordingScheduler(512, "deadline", None, max_prefill_batch=256, admission=admission)
        return scheduler, sorted(simulate(burst(100), scheduler, CostModel(), chunks=chunks),
                                 key=lambda r: r.request_id)

    _, everyone = run("all")
    assert not everyone[0].never_underran()
    scheduler, protected = run("protect")
    assert all(r.never_underran() for r in protected)
    assert max(r.admitted_at for r in protected) > 0.05  # some were deferred
    assert_wait_bounded(scheduler.steps, protected)


def assert_wait_bounded(steps: list[float], requests) -> None:
    """Each request is admitted by the first step that starts `MAX_ADMISSION_WAIT_S` after the step that first saw
    it ready (the scheduler looks between steps)."""
    for request in requests:
        seen = next(t for t in steps if t >= request.started_at)
        overdue = next(t for t in steps if t >= seen + MAX_ADMISSION_WAIT_S - 1e-9)
        assert request.admitted_at <= overdue + 1e-9


def test_protect_never_starves_under_poisson_load():
    """LLM-streamed text near capacity: `protect` defers prefills often, yet nobody waits past the bound."""
    scheduler = RecordingScheduler(512, "deadline", 256, admission="protect")
    requests = simulate(poisson_workload(40, 8, seed=2, streaming_text=True), scheduler, CostModel(), chunks="lead")
    assert max(r.admitted_at - r.started_at for r in requests) > 0.05
    assert_wait_bounded(scheduler.steps, requests)


@pytest.fixture(scope="module")
def tts(tiny_checkpoints) -> TTSModel:
    return TTSModel.load(tiny_checkpoints["custom_voice"])


TEXTS = ["Hello there, how are you today?", "A much longer sentence that keeps the model busy for a while.",
         "Short.", "Numbers like 12 and 345 are read too."]


def requests(tts: TTSModel, frames: list[int]) -> list[SynthesisRequest]:
    return [SynthesisRequest(text, tts.voice(VoiceRequest(speaker="ryan")), language="auto",
                             layout="streaming" if i % 2 else "prefill", max_frames=limit,
                             sampling=SamplingParams.from_defaults(tts.config.generation, seed=200 + i))
            for i, (text, limit) in enumerate(zip(TEXTS, frames))]


def run(engine: Engine, schedule: dict[int, list[SynthesisRequest]], step_s: float):
    """Submit at the given steps, each step `step_s` of the scheduler's clock; returns request index -> (audio, its
    chunk lengths in frames, the step of its first audio)."""
    clock = [0.0]
    engine.scheduler.clock = lambda: clock[0]
    ids, chunks, first, finished = {}, {}, {}, set()
    for step in range(400):
        for request in schedule.get(step, []):
            ids[engine.submit(request)] = len(ids)
        for event in engine.step():
            index = ids[event.request_id]
            if isinstance(event, AudioChunk):
                chunks.setdefault(index, []).append(event.samples)
                first.setdefault(index, step)
            else:
                assert isinstance(event, Finished) and event.reason in ("eos", "length")
                finished.add(index)
        clock[0] += step_s
        if engine.idle() and step > max(schedule):
            break
    assert finished == set(range(len(ids)))
    frame = engine.tts.decoder.samples_per_frame
    return {i: (np.concatenate(c), [len(a) // frame for a in c], first[i]) for i, c in chunks.items()}


@pytest.mark.parametrize("step_s", [0.03, 0.075], ids=["fast-steps", "near-real-time"])
def test_new_options_change_timing_not_audio(tts, one_thread, step_s):
    """Seeded sampling, joins at different steps, more requests than slots: with the lead schedule and `protect`
    each request's audio equals the defaults' and the offline decode of the single-request path. Fast steps build
    leads (chunks grow to 4 frames, later than 1, 1, 2, 4); near real time they stay thin (1-frame chunks) and
    `protect` defers a newcomer's prefill."""
    reqs = requests(tts, frames=[30, 24, 6, 18])
    schedule = {0: reqs[:2], 2: reqs[2:3], 5: reqs[3:]}
    config = dict(max_batch=3, capacity=256, chunk_frames=4, overlap_decoding=False)
    default = run(Engine(tts, EngineConfig(**config)), schedule, step_s)
    new = run(Engine(tts, EngineConfig(**config, chunk_schedule="lead", admission="protect")), schedule, step_s)
    lengths = [new[i][1] for i in new]
    if step_s < FRAME_SECONDS / 2:
        assert lengths != [default[i][1] for i in default] and max(map(max, lengths)) == 4
    else:
        assert set(map(max, lengths)) == {1} and any(new[i][2] > default[i][2] for i in new)
    for i, request in enumerate(reqs):
        expected = tts.synthesize(request.text, request.voice, language=request.language, layout=request.layout,
                                  sampling=request.sampling, max_frames=request.max_frames).audio
        np.testing.assert_allclose(new[i][0], default[i][0], atol=1e-5, rtol=0)
        np.testing.assert_allclose(new[i][0], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk_schedule", ["fixed", "lead"])
def test_a_busy_step_gives_first_chunks_two_frames_and_the_same_audio(tts, one_thread, chunk_schedule):
    """One-shot requests: one alone starts with one frame, two that join together (a step of 4 > `busy_batch` 2) start
    with two, one step later; an interactive request joining with them keeps its one-frame start; the first, busy
    from its second step on, goes on as it began (the busy rule lengthens first chunks only). Every request's audio
    is the one-frame start's and the offline decode's."""
    reqs = [replace(r, interactive=i == 3) for i, r in enumerate(requests(tts, frames=[30, 24, 12, 16]))]
    schedule = {0: reqs[:1], 1: reqs[1:]}
    config = dict(max_batch=4, capacity=256, chunk_frames=4, overlap_decoding=False, chunk_schedule=chunk_schedule)
    default = run(Engine(tts, EngineConfig(**config)), schedule, 0.03)
    busy = run(Engine(tts, EngineConfig(**config, busy_batch=2)), schedule, 0.03)
    assert [busy[i][1][0] for i in range(4)] == [1, 2, 2, 1]
    assert [default[i][1][0] for i in range(4)] == [1, 1, 1, 1]
    assert [busy[i][2] - default[i][2] for i in range(4)] == [0, 1, 1, 0]  # a step later
    assert busy[0][1] == default[0][1]
    if chunk_schedule == "fixed":
        assert busy[0][1][:4] == [1, 1, 2, 4]
    for i, request in enumerate(reqs):
        expected = tts.synthesize(request.text, request.voice, language=request.language, layout=request.layout,
                                  sampling=request.sampling, max_frames=request.max_frames).audio
        np.testing.assert_allclose(busy[i][0], default[i][0], atol=1e-5, rtol=0)
        np.testing.assert_allclose(busy[i][0], expected, atol=1e-5, rtol=0)


def test_lead_schedule_captures_every_length_it_makes(tts):
    engine = Engine(tts, EngineConfig(max_batch=1, capacity=64, chunk_frames=6, chunk_schedule="lead"))
    assert engine.decoding.chunk_lengths() == (1, 2, 4, 6)
    busy = dict(max_batch=1, capacity=64, chunk_frames=6, busy_batch=4)
    assert Engine(tts, EngineConfig(**busy, chunk_schedule="lead", first_chunk_frames=2)).decoding.chunk_lengths() \
        == (1, 2, 3, 4, 6)
    assert Engine(tts, EngineConfig(**busy)).decoding.chunk_lengths() == (1, 2, 4, 6)
    assert Engine(tts, EngineConfig(**{**busy, "chunk_frames": 3})).decoding.chunk_lengths() == (1, 2, 3)
    with pytest.raises(ValueError, match="first_chunk_frames below chunk_frames"):
        Engine(tts, EngineConfig(max_batch=1, capacity=64, chunk_frames=1, busy_batch=4))
    with pytest.raises(ValueError, match="unknown chunk schedule 'big'"):
        Engine(tts, EngineConfig(max_batch=1, capacity=64, chunk_schedule="big"))
    with pytest.raises(ValueError, match="unknown admission 'greedy'"):
        Engine(tts, EngineConfig(max_batch=1, capacity=64, admission="greedy"))


def test_streaming_text_with_the_new_options_gives_the_whole_texts_audio(tts, one_thread):
    """Text arriving word by word (the stream holds, its frames flush): the lead schedule's audio is the offline
    decode of the whole text's."""
    text = "Hello there, it's a fine day for a walk."
    voice = tts.voice(VoiceRequest(speaker="ryan"))
    sampling = SamplingParams.from_defaults(tts.config.generation, seed=7)
    engine = Engine(tts, EngineConfig(max_batch=2, capacity=256, chunk_schedule="lead", admission="protect"))
    clock = [0.0]
    engine.scheduler.clock = lambda: clock[0]
    request_id = engine.submit(SynthesisRequest("", voice, language="english", sampling=sampling,
                                                text_complete=False))
    words = [w + " " for w in text.split()]
    audio = []
    for step in range(600):
        if words and step % 2 == 0:
            engine.append_text(request_id, words.pop(0))
            if not words:
                engine.end_text(request_id)
        audio += [e.samples for e in engine.step() if isinstance(e, AudioChunk)]
        clock[0] += 0.02
        if engine.idle():
            break
    expected = tts.synthesize(text + " ", voice, language="english", layout="streaming", sampling=sampling).audio
    np.testing.assert_allclose(np.concatenate(audio), expected, atol=1e-5, rtol=0)
