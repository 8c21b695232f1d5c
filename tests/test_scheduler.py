"""Scheduling policies: on the simulator (the real scheduler, a virtual clock, the GPU cost model) and in the
engine, where the policy changes who steps when, never what a request sounds like."""
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.engine import Engine, EngineConfig
from engine.core.scheduler import ADMISSIONS, Scheduler, reserved_slots, spare_slots
from engine.core.simulator import Arrival, CostModel, burst_workload, poisson_workload, simulate, summarize
from engine.errors import EngineFull
from engine.request import AudioChunk, SynthesisRequest
from engine.sampling import SamplingParams
from engine.tts import TTSModel, VoiceRequest


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown scheduling policy 'lifo'"):
        Scheduler(1, "lifo")


def test_overload_deadline_keeps_streams_smooth_where_continuous_batching_fails():
    arrivals = poisson_workload(80, 20, seed=3)
    everyone = summarize(simulate(arrivals, Scheduler(512, "fcfs", None)))
    deadline = summarize(simulate(arrivals, Scheduler(512, "deadline", 256)))
    assert everyone["never_underrun"] < 0.5 < 0.99 < deadline["never_underrun"]


def test_new_requests_first_keeps_time_to_first_audio_low():
    """Near the step limit's capacity, fcfs makes newcomers wait behind streams that are far ahead."""
    arrivals = poisson_workload(50, 20, seed=4)
    fcfs = summarize(simulate(arrivals, Scheduler(512, "fcfs", 128)))
    deadline = summarize(simulate(arrivals, Scheduler(512, "deadline", 128)))
    assert deadline["ttfa_ms_p95"] < 100 < 300 < fcfs["ttfa_ms_p95"]
    assert deadline["never_underrun"] == fcfs["never_underrun"] == 1.0


def test_a_burst_of_sessions_opens_at_once_and_speaks_sooner_when_every_ready_request_is_admitted():
    """Sessions opened in the same instant (a server's start) each get their first text 0.1-0.3 s later; holding
    prefills for the thin buffers of the ones just started makes the later ones wait step after step (as measured on
    the GPU, docs/benchmarks.md "A burst of sessions")."""
    arrivals = burst_workload(128, seed=1, connect_s=0.05)
    assert max(a.at for a in arrivals) <= 0.05 and all(0.1 <= a.text_times[0] - a.at <= 0.3 for a in arrivals)
    every = summarize(simulate(arrivals, Scheduler(128, admission="all"), CostModel(), chunks="lead"))
    protected = summarize(simulate(arrivals, Scheduler(128, admission="protect"), CostModel(), chunks="lead"))
    assert every["requests"] == protected["requests"] == 128
    assert every["ttfa_ms_p95"] < 0.9 * protected["ttfa_ms_p95"]


def test_simulated_request_holds_until_its_text_arrives():
    """Frame k reads text token k + 1 (the prefill took token 0): with 3 tokens at t=0 and the rest at t=1 s, the
    request makes 2 frames, waits, then finishes after 1 s."""
    arrival = Arrival(0.0, 10, text_times=(0.0, 0.0, 0.0, 1.0, 1.0))
    (request,) = simulate([arrival], Scheduler(1), cost=CostModel(step_ms=10, per_request_ms=0, decode_per_frame_ms=0,
                                                                  prefill_ms=0, prefill_per_request_ms=0))
    assert request.delivered[:2] == pytest.approx([0.01, 0.02])
    assert request.delivered[2] == pytest.approx(1.01) and len(request.delivered) == 10


@dataclass(eq=False)
class Waiting:
    """A request that is ready at once, interactive (a conversation's) or one-shot (HTTP)."""
    request_id: int
    interactive: bool
    owner: str | None = None
    has_text: bool = True  # ready: its prefill has its text
    slot: int = -1
    frames: int = 0
    decoded_frames: int = 0
    first_audio_at: float | None = None
    done: str | None = None

    def ready(self) -> bool:
        return self.has_text

    def runnable(self) -> bool:
        return True


@settings(max_examples=200, deadline=None)
@given(slots=st.integers(1, 40), kinds=st.lists(st.booleans(), max_size=80), finished=st.integers(0, 40),
       admission=st.sampled_from(ADMISSIONS))
def test_one_shot_requests_leave_the_reserved_slots_to_interactive_ones(slots, kinds, finished, admission):
    """However one-shot (HTTP) and interactive requests arrive, one-shot requests never hold more than the slots
    less `reserved_slots`, an interactive request never waits while a slot is free, and each kind is admitted in
    its order of arrival; a slot freed later goes by the same rule."""
    scheduler = Scheduler(slots, max_prefill_batch=10**6, admission=admission)
    requests = [Waiting(index, interactive) for index, interactive in enumerate(kinds)]
    for request in requests:
        scheduler.add(request)

    def check() -> None:
        scheduler.admit(lambda request: True)
        running = scheduler.running.values()
        free = len(scheduler.free_slots)
        assert sum(not r.interactive for r in running) <= slots - scheduler.reserved
        assert not any(r.interactive for r in scheduler.waiting) or free == 0
        assert not any(not r.interactive for r in scheduler.waiting) or free <= scheduler.reserved
        for kind in (True, False):
            started = [r.request_id for r in requests if r.interactive is kind and r.slot >= 0]
            assert started == [r.request_id for r in requests if r.interactive is kind][:len(started)]

    check()
    for request in list(scheduler.running.values())[:finished]:
        scheduler.finish(request, "eos")
    check()


@settings(max_examples=200, deadline=None)
@given(slots=st.integers(1, 12), owners=st.lists(st.tuples(st.sampled_from(["a", "b", "c", None]), st.booleans()),
                                                min_size=1, max_size=40),
       finished=st.lists(st.integers(0, 11), max_size=20), admission=st.sampled_from(ADMISSIONS))
def test_owners_take_turns_for_the_slots(slots, owners, finished, admission):
    """However many requests one client queues, each free slot goes to a ready request of the owner that runs the
    fewest (a request without owner runs none), each owner's oldest first: a client's first request never waits
    behind another's many, nor behind its own requests that have no text yet. Slots freed later go by the same
    rule."""
    scheduler = Scheduler(slots, max_prefill_batch=10**6, admission=admission)
    requests = [Waiting(index, True, owner, has_text) for index, (owner, has_text) in enumerate(owners)]
    for request in requests:
        scheduler.add(request)

    def admit_and_check() -> None:
        turns = Counter(r.owner for r in scheduler.running.values() if r.owner is not None)
        free = len(scheduler.free_slots)
        candidates = [r for r in scheduler.waiting if r.ready()]

        def rank(r: Waiting) -> int:
            return 0 if r.owner is None else turns[r.owner]

        def may_start(r: Waiting) -> bool:  # an owner already running one leaves the reserve, holding half the spare
            held = turns[r.owner] if r.owner is not None else 0
            return free > max(reserved_slots(slots) if held else 0, spare_slots(slots) if 2 * held >= slots else 0)

        for request in scheduler.admit(lambda request: True):  # replayed turn by turn
            least = min(rank(r) for r in candidates if may_start(r))
            assert request is min((r for r in candidates if rank(r) == least and may_start(r)),
                                  key=lambda r: r.request_id)
            candidates.remove(request)
            free -= 1
            if request.owner is not None:
                turns[request.owner] += 1
        assert free == len(scheduler.free_slots)
        assert not any(may_start(r) for r in candidates)

    admit_and_check()
    for index in finished:
        running = list(scheduler.running.values())
        if running:
            scheduler.finish(running[index % len(running)], "eos")
            admit_and_check()


def test_a_clients_first_request_goes_before_anothers_queue():
    """The hostile try's case: one client holds every slot and queues more; another client's one request takes the
    next slot that frees, not the place behind the queue."""
    scheduler = Scheduler(4)
    hog = [Waiting(index, True, "hog") for index in range(12)]
    for request in hog:
        scheduler.add(request)
    scheduler.admit(lambda request: True)
    victim = Waiting(12, True, "victim")
    scheduler.add(victim)
    scheduler.finish(hog[0], "eos")
    assert scheduler.admit(lambda request: True) == [victim]


@settings(max_examples=200, deadline=None)
@given(slots=st.integers(1, 64), hogged=st.integers(1, 130), others=st.integers(0, 20), data=st.data())
def test_one_client_leaves_a_quarter_of_the_slots_to_the_others(slots, hogged, others, data):
    """However many requests one client queues, it holds at most the slots less a quarter (at least one; all of an
    engine of one slot), and that many requests of other clients arriving after it start at once; with requests of
    others running, it never takes the last spare free slots once it holds half."""
    scheduler = Scheduler(slots, max_prefill_batch=10**6)
    spare = spare_slots(slots)
    assert spare == (0 if slots == 1 else max(1, slots // 4))
    for index in range(others if data.draw(st.booleans()) else 0):  # others first: the hog then arrives
        scheduler.add(Waiting(1000 + index, True, f"early {index}"))
    scheduler.admit(lambda request: True)
    for index in range(hogged):
        scheduler.add(Waiting(index, True, "hog"))
    scheduler.admit(lambda request: True)
    held = sum(r.owner == "hog" for r in scheduler.running.values())
    assert held <= slots - spare
    if held < hogged and scheduler.free_slots:  # its requests wait beside free slots: the spare ones (it holds
        # half) or the reserve (it runs one) are all that is free
        assert len(scheduler.free_slots) <= (spare if 2 * held >= slots else reserved_slots(slots))
    late = [Waiting(2000 + index, True, f"late {index}") for index in range(min(spare, len(scheduler.free_slots)))]
    for request in late:
        scheduler.add(request)
    assert scheduler.admit(lambda request: True) == late


@settings(max_examples=300, deadline=None)
@given(slots=st.integers(1, 64), hogs=st.integers(2, 4), hogged=st.integers(1, 80), early=st.integers(0, 20))
def test_several_clients_that_fill_their_shares_leave_the_reserve_to_newcomers(slots, hogs, hogged, early):
    """A hostile try: two sessions of 8 long contexts each held all 8 slots, each under half of them, and a third
    client's first audio waited 35 s. Past its first, a client's request leaves the reserve (a sixteenth, at least
    one; none of an engine of one slot) to clients that run nothing: however many fill their shares, the reserve's
    worth of newcomers arriving after them start at once, unless the hogs' own first requests took it."""
    scheduler = Scheduler(slots, max_prefill_batch=10**6)
    reserve = reserved_slots(slots)
    for index in range(early):  # clients of one request each, there first
        scheduler.add(Waiting(1000 + index, True, f"early {index}"))
    scheduler.admit(lambda request: True)
    before = len(scheduler.free_slots)
    owners = [f"hog {hog}" for hog in range(hogs)]
    for index in range(hogged):
        for hog, owner in enumerate(owners):
            scheduler.add(Waiting(index * hogs + hog, True, owner))
    scheduler.admit(lambda request: True)
    held = Counter(r.owner for r in scheduler.running.values() if r.owner in owners)
    if sum(held.values()) < hogs * hogged:  # hogs' requests wait: they left the reserve, or their firsts took it
        assert len(scheduler.free_slots) >= min(reserve, before - min(hogs, before)), (held, before)
    late = [Waiting(5000 + index, True, f"late {index}") for index in range(len(scheduler.free_slots))]
    for request in late:
        scheduler.add(request)
    assert scheduler.admit(lambda request: True) == late


def test_the_reserve_and_its_waiting_places():
    """A sixteenth of the slots, at least one, none for one slot; a one-shot request finds the waiting room full
    that many places before an interactive one."""
    assert [reserved_slots(n) for n in (1, 2, 8, 16, 64, 256)] == [0, 1, 1, 1, 4, 16]
    scheduler = Scheduler(8, max_waiting=3)
    for index in range(2):
        scheduler.add(Waiting(index, interactive=False))
    with pytest.raises(EngineFull):
        scheduler.check_room(interactive=False)
    scheduler.check_room(interactive=True)


@pytest.fixture(scope="module")
def tts(tiny_checkpoints) -> TTSModel:
    return TTSModel.load(tiny_checkpoints["custom_voice"])


class StepClock:
    """The engine's scheduler clock, moved on by a fixed 10 ms at each reading: a fast device, whatever this CPU's
    speed (the deadline policy compares audio made with time passed)."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 0.01
        return self.now


def test_step_limit_order_and_the_audio_it_does_not_change(tts):
    """One request per step: under fcfs the newcomer waits for the first request to finish; under deadline it starts
    once the first has half a second of audio to spare. Either way each request gets its single-request audio."""
    clock = StepClock()
    voice = tts.voice(VoiceRequest(speaker="ryan"))

    def request(text: str, seed: int, frames: int) -> SynthesisRequest:
        return SynthesisRequest(text, voice, language="english", layout="streaming", max_frames=frames,
                                sampling=SamplingParams.from_defaults(tts.config.generation, seed=seed))

    first, late = request("The first request, a longer one.", 1, 60), request("A late one.", 2, 8)
    for policy in ("fcfs", "deadline"):
        engine = Engine(tts, EngineConfig(max_batch=2, capacity=128, scheduling=policy, max_step_batch=1))
        engine.scheduler.clock = clock.monotonic  # where the engine reads time: deadlines and first audio
        ids = [engine.submit(first)]
        audio: dict[int, list] = {}
        first_frames_when_late_started = None
        while not engine.idle():
            if engine.running and len(ids) == 1:
                ids.append(engine.submit(late))
            for event in engine.step():
                if isinstance(event, AudioChunk):
                    audio.setdefault(event.request_id, []).append(event.samples)
            late_seq = engine.running.get(ids[-1]) if len(ids) == 2 else None
            if late_seq is not None and late_seq.frames and first_frames_when_late_started is None:
                first_seq = engine.running.get(ids[0])
                first_frames_when_late_started = first_seq.frames if first_seq else first.max_frames
        if policy == "fcfs":
            assert first_frames_when_late_started == first.max_frames
        else:
            assert 7 <= first_frames_when_late_started <= 12  # 0.5 s ahead: 6.25 frames and the time taken
        for request_id, req in zip(ids, (first, late)):
            expected = tts.synthesize(req.text, voice, language="english", layout="streaming",
                                      sampling=req.sampling, max_frames=req.max_frames).audio
            np.testing.assert_allclose(np.concatenate(audio[request_id]), expected, atol=1e-5, rtol=0)


def test_a_lead_target_holds_a_stream_far_ahead_until_a_request_waits_for_a_slot():
    """An interactive request whose audio is the target ahead of its client's playback holds, and says when it falls
    below it; a one-shot request, one below the target and one without audio yet step; once a ready request waits
    for a slot, all of them step."""
    now = 10.0
    scheduler = Scheduler(4, lead_target_s=1.0, clock=lambda: now)
    ahead = Waiting(0, True, frames=26, first_audio_at=now - 1.0)  # 2.08 s made, 1 s played: 1.08 s ahead
    below = Waiting(1, True, frames=24, first_audio_at=now - 1.0)
    one_shot = Waiting(2, False, frames=26, first_audio_at=now - 1.0)
    for request in (ahead, below, one_shot):
        scheduler.add(request)
    assert scheduler.admit(lambda request: True) == [ahead, below, one_shot]
    assert scheduler.schedule() == ([below, one_shot], [ahead])
    assert scheduler.next_release() == pytest.approx(now + 0.08) and scheduler.steppable()
    scheduler.add(Waiting(3, True, has_text=False))  # waiting, but not ready: no slot is wanted yet
    assert scheduler.schedule() == ([below, one_shot], [ahead])
    scheduler.waiting[0].has_text = True
    assert scheduler.schedule() == ([ahead, below, one_shot], []) and scheduler.next_release() is None
    alone = Scheduler(1, lead_target_s=1.0, clock=lambda: now)
    alone.add(Waiting(0, True, frames=26, first_audio_at=now - 1.0))
    alone.admit(lambda request: True)
    assert not alone.steppable() and Scheduler(1).next_release() is None
    quiet = Scheduler(4, lead_target_s=1.0, busy_rows=2, clock=lambda: now)  # held only while more than 2 run
    for request_id in range(3):
        quiet.add(Waiting(request_id, True, frames=26, first_audio_at=now - 1.0))
    quiet.admit(lambda request: True)
    assert quiet.schedule()[1] == list(quiet.running.values())
    quiet.cancel(2)
    assert quiet.schedule() == (list(quiet.running.values()), []) and quiet.next_release() is None
    with pytest.raises(ValueError, match="positive"):
        Scheduler(1, lead_target_s=float("nan"))


def _largest_lead(request) -> float:
    """The most audio a request had out ahead of a client playing since its first audio."""
    start = request.delivered[0]
    return max((i + 1) * 0.08 - (out - start) for i, out in enumerate(request.delivered))


def test_a_lead_target_keeps_a_burst_near_real_time_without_a_stream_running_dry():
    """A burst of LLM-paced sessions on free slots (the simulator's GPU cost model): without a target the streams
    run seconds ahead of their players (the audio a gateway must encode in a burst); with 1 s they stay within a
    chunk of it and make 40% less audio in the burst's first 3 s, with no more streams running dry (those whose
    LLM text comes slower than their speech run dry either way) and first audio no later."""
    arrivals = burst_workload(128, seed=2, connect_s=0.05)

    def run(target: float | None):
        requests = simulate(arrivals, Scheduler(128, lead_target_s=target), CostModel(), chunks="lead")
        early = sum(out < 3.0 for r in requests for out in r.delivered)
        return summarize(requests), max(_largest_lead(r) for r in requests), early

    (free, free_lead, free_early), (held, held_lead, held_early) = run(None), run(1.0)
    assert free_lead > 3.0 and held_lead < 1.0 + 0.4, (free_lead, held_lead)
    assert held_early < 0.7 * free_early, (held_early, free_early)
    assert free["never_underrun"] == held["never_underrun"] > 0.95
    assert held["ttfa_ms_p95"] <= free["ttfa_ms_p95"] * 1.05, (held, free)


def test_the_engine_waits_out_a_lead_target_and_its_audio_stays_the_same(tts):
    """On the engine (a clock that moves only when told): a request at its lead target leaves no work, the loop may
    wait until it falls below (and no longer), then it steps again; its audio is its single-request audio."""
    now = [0.0]
    voice = tts.voice(VoiceRequest(speaker="ryan"))
    request = SynthesisRequest("A stream held near its lead target.", voice, language="english", layout="streaming",
                               max_frames=30, sampling=SamplingParams.from_defaults(tts.config.generation, seed=3))
    engine = Engine(tts, EngineConfig(max_batch=2, capacity=128, lead_target_s=0.5))
    engine.scheduler.clock = lambda: now[0]
    engine.submit(request)
    audio, waits = [], []
    while not engine.idle():
        if not engine.has_work():
            wait = engine.idle_wait_s(10.0)
            assert 0 < wait <= 0.08 + 1e-9  # one frame of audio played brings it below the target
            (seq,) = engine.running.values()
            assert seq.frames * 0.08 - (now[0] - seq.first_audio_at) > 0.5
            waits.append(wait)
            now[0] += wait
            continue
        audio += [event.samples for event in engine.step() if isinstance(event, AudioChunk)]
    assert len(waits) >= 20  # 30 frames, 0.5 s (7 frames) ahead at most: nearly every frame waited for
    expected = tts.synthesize(request.text, voice, language="english", layout="streaming", sampling=request.sampling,
                              max_frames=request.max_frames).audio
    np.testing.assert_allclose(np.concatenate(audio), expected, atol=1e-5, rtol=0)
