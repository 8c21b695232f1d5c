"""The batched engine against the single-request reference path: same codes and audio whatever the batch, the
join times or the cancellations (fp32, CPU, tiny checkpoints)."""
import numpy as np
import pytest
import torch

from engine.core.engine import Engine, EngineConfig
from engine.errors import EngineFull, TextTooLong
from engine.request import AudioChunk, Finished, SynthesisRequest
from engine.sampling import SamplingParams
from engine.tts import TTSModel, VoiceRequest

TEXTS = ["Hello there, how are you today?", "A much longer sentence that keeps the model busy for a while.",
         "Short.", "Numbers like 12 and 345 are read too.", "你好，世界！"]
SPEAKERS = ["vivian", "ryan", "serena", "eric", "aiden"]


@pytest.fixture(scope="module")
def tts(tiny_checkpoints) -> TTSModel:
    return TTSModel.load(tiny_checkpoints["custom_voice"])


def requests(tts: TTSModel, greedy: bool, frames: list[int]) -> list[SynthesisRequest]:
    out = []
    for i, (text, speaker, limit) in enumerate(zip(TEXTS, SPEAKERS, frames)):
        sampling = SamplingParams.from_defaults(tts.config.generation, greedy=greedy, seed=100 + i)
        out.append(SynthesisRequest(text, tts.voice(VoiceRequest(speaker=speaker)), language="auto",
                                    layout="streaming" if i % 2 else "prefill", sampling=sampling,
                                    max_frames=limit))
    return out


def run(engine: Engine, schedule: dict[int, list[SynthesisRequest]], cancel_at: dict[int, int] | None = None):
    """Submit requests at the given steps; returns request index -> (codes, audio, finish)."""
    ids, audio, finished = {}, {}, {}
    cancelled: set[int] = set()
    step = 0
    while step in schedule or not engine.idle() or any(s > step for s in schedule):
        for request in schedule.get(step, []):
            ids[engine.submit(request)] = len(ids)
        for index, at in (cancel_at or {}).items():
            if at == step:
                assert engine.cancel([i for i, j in ids.items() if j == index][0])
                finished[index] = "cancelled"
                cancelled.add(index)
        for event in engine.step():
            index = ids[event.request_id]
            assert index not in cancelled, "an event after the request was cancelled"
            if isinstance(event, AudioChunk):
                chunks = audio.setdefault(index, [])
                assert event.start_sample == sum(len(c) for c in chunks)  # contiguous, in order
                chunks.append(event.samples)
            else:
                assert isinstance(event, Finished)
                finished[index] = event
        step += 1
        assert step < 500
    return {i: (np.concatenate(audio.get(i, [np.zeros(0, np.float32)])), finished[i]) for i in finished}


def reference(tts: TTSModel, request: SynthesisRequest):
    return tts.synthesize(request.text, request.voice, language=request.language, layout=request.layout,
                          sampling=request.sampling, max_frames=request.max_frames)


@pytest.mark.parametrize("greedy,mode,backend,overlap", [
    (True, "eager", "sdpa", False), (False, "eager", "sdpa", False), (True, "padded", "sdpa", False),
    (False, "padded", "triton", False), (False, "padded", "sdpa", True)],
    ids=["greedy", "seeded", "greedy-padded-buckets", "seeded-padded-triton", "seeded-overlapped-decoding"])
def test_batched_engine_equals_the_single_request_path(tts, greedy, mode, backend, overlap):
    reqs = requests(tts, greedy, frames=[9, 14, 5, 11, 7])
    engine = Engine(tts, EngineConfig(max_batch=3, capacity=256, first_chunk_frames=1, chunk_frames=3,
                                      step_mode=mode, attention_backend=backend, overlap_decoding=overlap))
    # Joins at different steps; more requests than slots, so some wait for a slot to free up.
    results = run(engine, {0: reqs[:2], 3: reqs[2:4], 6: reqs[4:]})
    for i, request in enumerate(reqs):
        expected = reference(tts, request)
        audio, finish = results[i]
        assert finish.frames == expected.codes.shape[0]
        assert len(audio) == len(expected.audio)
        np.testing.assert_allclose(audio, expected.audio, atol=1e-5, rtol=0)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_fused_frame_path_equals_the_single_request_path(tts, greedy):
    """The Triton frame path (fused layers, varlen prefill, one-kernel sampling) run by the interpreter: a request
    joining a running one gets exactly the reference path's audio."""
    reqs = requests(tts, greedy, frames=[7, 5])
    engine = Engine(tts, EngineConfig(max_batch=2, capacity=128, chunk_frames=2, step_mode="padded",
                                      attention_backend="triton", frame_path="triton"))
    results = run(engine, {0: reqs[:1], 2: reqs[1:]})
    for i, request in enumerate(reqs):
        expected = reference(tts, request)
        audio, finish = results[i]
        assert finish.frames == expected.codes.shape[0]
        np.testing.assert_allclose(audio, expected.audio, atol=1e-5, rtol=0)


def test_codes_match_frame_for_frame(tts):
    """The engine's codes, read back from its runner, equal the reference path's."""
    request = requests(tts, True, frames=[12])[0]
    engine = Engine(tts, EngineConfig(max_batch=2, capacity=128))
    frames = []
    original = engine.runner.run
    engine.runner.run = lambda batch: frames.append(original(batch)) or frames[-1]
    other = requests(tts, True, frames=[30, 30])[1]
    run(engine, {0: [other], 2: [request]})
    expected = reference(tts, request).codes
    got = torch.stack([f.host()[-1] for f in frames[2:14]])  # the late joiner: steps 2..13, the last row of each
    assert torch.equal(got, expected)


def test_chunks_split_into_graphed_lengths_give_the_same_audio(tts):
    """A due chunk whose length has no decoder graph is decoded as pieces that have one (here 3 = 2 + 1)."""
    reqs = requests(tts, False, frames=[10, 8])
    engine = Engine(tts, EngineConfig(max_batch=2, capacity=128, chunk_frames=3))
    decoders = engine.decoding.decoders
    decoders.graphed_lengths = (2, 1)
    assert decoders.pieces(3) == [2, 1] and decoders.pieces(2) == [2]
    results = run(engine, {0: reqs[:1], 1: reqs[1:]})
    for i, request in enumerate(reqs):
        np.testing.assert_allclose(results[i][0], reference(tts, request).audio, atol=1e-5, rtol=0)


class LateCopy:
    """A decode's copy to the host that lands only after a few polls (a GPU decoder slower than the frame step);
    waiting for it lands it."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def synchronize(self) -> None:
        self.polls = -1


@pytest.mark.parametrize("polls", [1, 3], ids=["lands-next-poll", "lands-late"])
def test_steps_poll_decodes_and_wait_only_for_old_ones(tts, polls):
    """With decodes that land late, a step delivers what has landed and goes on: audio stays complete and in order
    (equal to the reference), a Finished follows its request's last chunk, and no decode stays in flight for more
    than the step after the one that queued it."""
    reqs = requests(tts, False, frames=[9, 14, 5])
    engine = Engine(tts, EngineConfig(max_batch=3, capacity=256, chunk_frames=3, overlap_decoding=True))
    overlap = engine.decoding.overlap
    to_host = overlap.to_host

    def late(owners, audio):
        pending = to_host(owners, audio)
        pending.ready = LateCopy(polls)
        return pending

    overlap.to_host = late
    original_step, ended, backlog = engine.step, set(), []

    def step(on_audio=None):
        events = original_step(on_audio)
        for event in events:
            assert event.request_id not in ended, "an event after its request's Finished"
            if isinstance(event, Finished):
                ended.add(event.request_id)
        backlog.append(engine.decoding.queued_steps - min((p.step for p in engine.decoding.in_flight),
                                                          default=engine.decoding.queued_steps))
        return events

    engine.step = step
    results = run(engine, {0: reqs[:2], 2: reqs[2:]})
    for i, request in enumerate(reqs):
        np.testing.assert_allclose(results[i][0], reference(tts, request).audio, atol=1e-5, rtol=0)
    assert max(backlog) <= 1  # at most the latest step's decodes are still on their way
    assert polls == 1 or any(backlog)  # late copies were really left in flight across a step


def test_a_first_chunk_is_decoded_first_and_waited_for_without_its_steps_larger_chunks(tts):
    """A newcomer joins running requests whose larger chunks are due in the same step: its first chunk is queued
    before them, and the step delivers it at once while their decodes, still on their way, stay in flight."""
    reqs = requests(tts, False, frames=[30, 30, 12])
    engine = Engine(tts, EngineConfig(max_batch=3, capacity=256, chunk_frames=4, overlap_decoding=True))
    overlap = engine.decoding.overlap
    to_host = overlap.to_host

    def never_lands(owners, audio):  # lands only when waited for
        pending = to_host(owners, audio)
        pending.ready = LateCopy(10**9)
        return pending

    overlap.to_host = never_lands
    ids = [engine.submit(request) for request in reqs[:2]]
    engine.step()
    runners = [engine.running[i] for i in ids]
    while min(seq.decoded_frames for seq in runners) < 4:  # their chunks have grown past one frame
        engine.step()
    while any(len(seq.pending) + 1 < engine.decoding.chunk_due(seq.decoded_frames, 1) for seq in runners):
        engine.step()  # the next step has both runners' chunks due
    newcomer = engine.submit(reqs[2])
    events = engine.step()
    first = [e for e in events if isinstance(e, AudioChunk) and e.request_id == newcomer]
    assert first and first[0].start_sample == 0  # the newcomer's first audio is out in its first step
    in_flight = {seq.request_id for pending in engine.decoding.in_flight for seq, _ in pending.owners}
    assert in_flight == set(ids)  # the runners' chunks of that step were not waited for
    while not engine.idle():
        engine.step()


@pytest.mark.parametrize("overlap", [False, True], ids=["in-step-decoding", "overlapped-decoding"])
def test_cancel_frees_the_slot_and_stops_events(tts, overlap):
    """Overlapped: a chunk of the cancelled request is still being decoded when it is cancelled, and is dropped."""
    reqs = requests(tts, True, frames=[40, 40, 6])
    engine = Engine(tts, EngineConfig(max_batch=2, capacity=128, overlap_decoding=overlap))
    results = run(engine, {0: reqs[:2], 1: [reqs[2]]}, cancel_at={0: 4})
    assert results[0][1] == "cancelled"
    assert isinstance(results[2][1], Finished)  # the waiting request got the freed slot
    np.testing.assert_allclose(results[2][0], reference(tts, reqs[2]).audio, atol=1e-5, rtol=0)
    assert engine.idle() and len(engine.free_slots) == 2


def test_full_engine_refuses_with_a_clear_error(tts):
    engine = Engine(tts, EngineConfig(max_batch=1, capacity=128, max_waiting=2))
    request = requests(tts, True, frames=[3])[0]
    engine.submit(request)
    engine.submit(request)
    with pytest.raises(EngineFull, match="engine is full"):
        engine.submit(request)


def test_prompt_longer_than_the_context_is_refused(tts):
    engine = Engine(tts, EngineConfig(max_batch=1, capacity=8))
    with pytest.raises(TextTooLong, match="more than the engine.s context of 8"):
        engine.submit(requests(tts, True, frames=[3, 3])[1])


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("own_limit", [None, 200])
def test_a_request_that_fills_its_kv_slot_ends_with_text_too_long_after_its_audio(tts, streaming, own_limit):
    """Text longer than the slot: the audio that fit comes out, then the request ends with TextTooLong (its end was
    not spoken), never as a normal finish. Ending at its own limit below the slot stays a normal finish."""
    engine = Engine(tts, EngineConfig(max_batch=1, capacity=96))  # 60 words: a prompt of ~70 in prefill layout
    base = requests(tts, True, frames=[None])[0]
    text = " ".join(["word"] * 60)  # the runaway guard allows 10 frames a token: far more than the slot
    request = SynthesisRequest(text, base.voice, language="auto", layout="streaming" if streaming else "prefill",
                               sampling=base.sampling, max_frames=own_limit, text_complete=not streaming)
    request_id = engine.submit(request)
    if streaming:
        engine.end_text(request_id)
    events = [event for _ in range(300) if not engine.idle() for event in engine.step()]
    finished = events[-1]
    assert finished.reason == "error" and isinstance(finished.error, TextTooLong), finished
    samples = sum(len(event.samples) for event in events if isinstance(event, AudioChunk))
    assert 0 < finished.frames < 96 and samples == finished.frames * tts.decoder.samples_per_frame
    short = SynthesisRequest(text, base.voice, language="auto", layout="prefill", sampling=base.sampling,
                             max_frames=5)
    assert run(Engine(tts, EngineConfig(max_batch=1, capacity=96)), {0: [short]})[0][1].reason == "length"


def test_attention_the_frame_path_would_ignore_is_refused(tts):
    """The triton frame path attends with its own kernel: naming another attention is an error, not a no-op."""
    with pytest.raises(ValueError, match="would be ignored"):
        Engine(tts, EngineConfig(max_batch=1, capacity=8, frame_path="triton", attention_backend="sdpa"))


def test_kv_budget_sets_the_number_of_slots(tts):
    layers = tts.config.talker.layers
    per_slot = 2 * layers.num_hidden_layers * layers.num_key_value_heads * layers.head_dim * 100 * 4
    engine = Engine(tts, EngineConfig(max_batch=64, capacity=100, kv_budget_bytes=5 * per_slot + 7))
    assert engine.slots == 5


def test_slots_sized_by_free_memory_are_a_graph_bucket(tts, monkeypatch):
    """A share of the GPU's free memory sizes the slots (as a server's default), rounded down to a CUDA graph's batch
    size so that a full batch is still graphed; given a fixed budget the slots are exactly what it holds."""
    layers = tts.config.talker.layers
    per_slot = 2 * layers.num_hidden_layers * layers.num_key_value_heads * layers.head_dim * 100 * 4
    monkeypatch.setattr(Engine, "_free_memory", staticmethod(lambda device: int(200.5 * per_slot / 0.65)))
    assert Engine(tts, EngineConfig(max_batch=256, capacity=100, kv_memory_share=0.65)).slots == 192
    assert Engine(tts, EngineConfig(max_batch=100, capacity=100, kv_memory_share=0.65)).slots == 96
    assert Engine(tts, EngineConfig(max_batch=256, capacity=100, kv_budget_bytes=200 * per_slot)).slots == 200


@pytest.mark.parametrize("free_slots, reserve_slots, share, expected", [
    (300, 10, 0.85, 255),  # the share (255) is less than free less the reserve (290)
    (300, 60, 0.85, 240),  # the reserve binds: 300 - 60
    (300, 200, 0.85, 127.5),  # the reserve would leave less than half the share: half the share
])
def test_the_kv_budget_keeps_the_reserve_free_but_at_least_half_the_share(tts, monkeypatch, free_slots, reserve_slots,
                                                                          share, expected):
    """The server's sizing: a share of the free memory, less whatever would leave under the reserve for the rest of
    the engine (an H100's 256 slots then do not hang on half a GiB of spare memory), never under half the share (a
    small GPU still gets slots). Budgets in slots of the tiny model here."""
    layers = tts.config.talker.layers
    per_slot = 2 * layers.num_hidden_layers * layers.num_key_value_heads * layers.head_dim * 100 * 4
    monkeypatch.setattr(Engine, "_free_memory", staticmethod(lambda device: free_slots * per_slot))
    config = EngineConfig(capacity=100, kv_memory_share=share, kv_memory_reserve_bytes=reserve_slots * per_slot)
    assert Engine._kv_budget(tts.device, config) == int(expected * per_slot)
    with pytest.raises(ValueError, match="between 0 and 1"):
        Engine._kv_budget(tts.device, EngineConfig(kv_memory_share=1.5))


@pytest.mark.parametrize("joined_at", [0, 3])
def test_seeded_audio_is_bit_equal_alone_and_batched(tts, joined_at):
    """PROTOCOL.md's seed guarantee, exactly in fp32: a seeded request's audio is the same bits whatever it is batched
    with (others submitted with it, or a few steps before it)."""
    probe, *others = requests(tts, False, frames=[14, 10, 12, 9, 11])
    alone = run(Engine(tts, EngineConfig(max_batch=8, capacity=128)), {0: [probe]})[0][0]
    batched = run(Engine(tts, EngineConfig(max_batch=8, capacity=128)), {0: others, joined_at: [probe]}
                  if joined_at else {0: [probe, *others]})
    probe_index = 0 if not joined_at else len(others)
    assert len(alone) and np.array_equal(batched[probe_index][0], alone)


def _one_slot_held(tts, slots: int) -> tuple[Engine, SynthesisRequest, int]:
    """An engine of `slots` with one streaming-text request stepped until it holds (its next text has not come)."""
    engine = Engine(tts, EngineConfig(max_batch=slots, capacity=128))
    base = requests(tts, True, frames=[None])[0]
    held = engine.submit(SynthesisRequest("Hello there, ", base.voice, sampling=base.sampling, text_complete=False))
    for _ in range(100):
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work() and held in engine.running
    return engine, base, held


def test_a_waiting_request_without_a_free_slot_is_no_work(tts):
    """The step loop steps while there is work: a request waiting for a slot that a held request keeps (its text
    has not come) is not work, or the loop spun at 100% of a core stepping nothing until the slot freed."""
    engine, base, held = _one_slot_held(tts, slots=1)
    engine.submit(SynthesisRequest("Waiting.", base.voice, sampling=base.sampling))
    assert not engine.has_work()
    engine.cancel(held)
    assert engine.has_work()  # the slot is free: the waiting request is admitted by the next step


def test_a_one_shot_request_waiting_for_more_than_the_reserved_slot_is_no_work(tts):
    """Two slots, one reserved for interactive requests: a one-shot request that finds only the reserved slot free
    waits, and is no work (the loop spun on it, stepping nothing: a hostile try's HTTP readers that read nothing
    made it); an interactive request takes the reserved slot at once."""
    engine, base, held = _one_slot_held(tts, slots=2)
    one_shot = engine.submit(SynthesisRequest("Waiting.", base.voice, sampling=base.sampling, interactive=False))
    assert not engine.has_work()
    conversation = engine.submit(SynthesisRequest("Now.", base.voice, sampling=base.sampling))
    assert engine.has_work()
    engine.step()
    assert conversation in engine.running and one_shot not in engine.running


@pytest.mark.parametrize("paused_at", [0, 3])
def test_a_paused_request_runs_no_frame_keeps_its_slot_and_speaks_the_same_when_resumed(tts, paused_at):
    """A request whose client reads too slowly is paused: it runs no frame (the step loop has no work for it alone),
    keeps its slot (one paused before it started waits without taking one), its audio made before still arrives; resumed, it goes on to the same audio as a request that never
    paused (seeded, fp32: the same codes; the frames made before the pause are decoded in chunks of their own, so the
    waveform agrees to float rounding), while the request beside it runs on."""
    probe, other = requests(tts, False, frames=[14, 10])
    alone = run(Engine(tts, EngineConfig(max_batch=8, capacity=128)), {0: [probe]})[0][0]
    engine = Engine(tts, EngineConfig(max_batch=8, capacity=128))
    probe_id, other_id = engine.submit(probe), engine.submit(other)
    audio: dict[int, list[np.ndarray]] = {probe_id: [], other_id: []}
    done: set[int] = set()

    def step() -> None:
        for event in engine.step():
            if isinstance(event, AudioChunk):
                audio[event.request_id].append(event.samples)
            else:
                done.add(event.request_id)

    for _ in range(paused_at):
        step()
    engine.pause(probe_id, True)
    frames = engine.scheduler.find(probe_id).frames
    for _ in range(40):  # the other request runs to its end meanwhile
        if not engine.has_work():
            break
        step()
    assert other_id in done and probe_id not in done and not engine.has_work()
    assert engine.scheduler.find(probe_id).frames == frames  # no frame ran
    assert (probe_id in engine.running) == (paused_at > 0)  # its slot kept; none taken by one not started
    engine.pause(probe_id, False)
    for _ in range(60):
        if engine.idle():
            break
        step()
    paused = np.concatenate(audio[probe_id])
    assert probe_id in done and paused.shape == alone.shape and np.allclose(paused, alone, rtol=0, atol=1e-5)
