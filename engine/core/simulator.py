"""The engine's scheduling on a virtual clock: the real `Scheduler` (admission, hold rule, selection, ends) and a
cost model of the GPU step in place of the model, so that policies are compared in seconds on a CPU (and in CI).

The cost model's defaults are fitted from the H100 1.7B runs in docs/benchmarks.md: a frame step of 6.6 ms at
batch 1 growing ~0.05 ms per request (12.9 ms at 128), codec decoding ~0.11 ms per generated frame (offline, 427
audio s/s at batch 256); a prefill pass of ~10 ms (eager, launch-bound: single-request time to first audio, 23 ms,
less the step and the first decode) plus ~0.5 ms per request in it.

Frames are delivered one of two ways. `chunks=None` (the default, the idealised model): each frame's audio is out at
the end of the step that made it, its decoding charged per frame. `chunks="fixed"` or `"lead"`: the engine's chunk
schedules (`engine/core/decoding.py`): a request's frames wait until its chunk is due, then all of them are out at
the end of that step, which pays for the decodes: a batched decoder call per chunk length, a cost per chunk and one
per frame (`CostModel.decode_seconds`; the per-call and per-chunk costs are estimates, not yet fitted).

A simulated client starts playing a request's audio at its first audio out; a frame out after its playback time is an
underrun. With streaming text, latency runs from the first text token, and a frame can run only once its text token
has arrived (one token per frame, then the end of the input), as in the engine.
"""
from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.core.decoding import CHUNK_SCHEDULES, first_chunk, fixed_chunk, lead_chunk
from engine.core.scheduler import FRAME_SECONDS, Scheduler, lead


@dataclass(frozen=True)
class CostModel:
    step_ms: float = 6.6
    per_request_ms: float = 0.05
    decode_per_frame_ms: float = 0.11
    prefill_ms: float = 10.0  # a prefill pass (eager: launch-bound)
    prefill_per_request_ms: float = 0.5
    decode_call_ms: float = 0.3  # a batched decoder call (one per chunk length in a step): launch, sync
    decode_per_chunk_ms: float = 0.1  # a request's chunk whatever its length: its window attention, its state

    def step_seconds(self, batch: int, admitted: int) -> float:
        """A step whose frames are all decoded at once (`chunks=None`)."""
        return self.frame_seconds(batch, admitted) + batch * self.decode_per_frame_ms / 1e3

    def frame_seconds(self, batch: int, admitted: int) -> float:
        """A step's prefill and frame, without decoding."""
        prefill = self.prefill_ms + admitted * self.prefill_per_request_ms if admitted else 0.0
        return (self.step_ms + batch * self.per_request_ms + prefill) / 1e3

    def decode_seconds(self, chunks: list[int]) -> float:
        """Decoding the chunks due in a step (their lengths in frames), one batched call per length."""
        calls = len(set(chunks)) * self.decode_call_ms
        return (calls + len(chunks) * self.decode_per_chunk_ms + sum(chunks) * self.decode_per_frame_ms) / 1e3


@dataclass(frozen=True)
class Arrival:
    at: float
    frames: int
    text_times: tuple[float, ...] = ()  # arrival of each text token (streaming text); empty: all text at `at`
    interactive: bool = True  # False: a one-shot request (HTTP), as SynthesisRequest's
    owner: str | None = None  # as SynthesisRequest's


@dataclass
class VirtualClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(eq=False)  # compared by identity, as the engine's sequences
class SimRequest:
    request_id: int
    arrival: Arrival
    clock: VirtualClock
    slot: int = -1
    frames: int = 0
    decoded_frames: int = 0  # frames whose audio is out
    first_audio_at: float | None = None  # when its first frame was made (the scheduler's first audio)
    admitted_at: float | None = None  # when its prefill ran
    done: str | None = None
    delivered: list[float] = field(default_factory=list)  # when each frame's audio was out

    @property
    def interactive(self) -> bool:
        """A conversation's request, as SynthesisRequest's (the scheduler's reserved slots, the busy start)."""
        return self.arrival.interactive

    @property
    def owner(self) -> str | None:
        return self.arrival.owner

    def _tokens(self) -> int:
        return sum(t <= self.clock.now for t in self.arrival.text_times)

    def _text_complete(self) -> bool:
        return not self.arrival.text_times or self.arrival.text_times[-1] <= self.clock.now

    def ready(self) -> bool:
        """The prefill has its first text token."""
        return self._text_complete() or self._tokens() >= 1

    def runnable(self) -> bool:
        """The next frame's text token is in (frame k reads token k; the frame after the last reads the end)."""
        return self._text_complete() or self.frames + 1 < self._tokens()

    @property
    def started_at(self) -> float:
        """Where latency counts from: the request, or its first text token."""
        return self.arrival.text_times[0] if self.arrival.text_times else self.arrival.at

    @property
    def pending(self) -> int:
        """Frames made whose audio is not out yet."""
        return self.frames - self.decoded_frames

    def never_underran(self) -> bool:
        """Each frame was out before a client playing since the first audio out reached it."""
        return all(t <= self.delivered[0] + k * FRAME_SECONDS + 1e-9 for k, t in enumerate(self.delivered))


def simulate(arrivals: list[Arrival], scheduler: Scheduler, cost: CostModel = CostModel(),
             chunks: str | None = None, first_chunk_frames: int = 1, chunk_frames: int = 4,
             busy_batch: int | None = None) -> list[SimRequest]:
    """Run every arrival to its length through `scheduler` (a new one: its queues empty), which is put on the
    simulation's virtual clock; returns the requests with their frame times. `chunks`: None (each frame out as it is
    made) or one of `CHUNK_SCHEDULES`, with the engine's `first_chunk_frames`, `chunk_frames` and `busy_batch`."""
    if chunks is not None and chunks not in CHUNK_SCHEDULES:
        raise ValueError(f"unknown chunk schedule {chunks!r}; choose None or one of {', '.join(CHUNK_SCHEDULES)}")
    clock = scheduler.clock = VirtualClock()
    pending = deque(sorted(arrivals, key=lambda a: a.at))
    finished: list[SimRequest] = []
    ids = 0
    while pending or not scheduler.idle():
        while pending and pending[0].at <= clock.now:
            ids += 1
            scheduler.add(SimRequest(ids, pending.popleft(), clock))
        admitted = scheduler.admit(lambda request: True)
        for request in admitted:
            request.admitted_at = clock.now
        batch, held = scheduler.schedule()
        if not batch and not admitted and not any(r.pending for r in held):
            clock.now = _next_event(clock.now, pending, [*scheduler.waiting, *scheduler.running.values()],
                                    scheduler.next_release())
            continue
        if chunks is None:
            clock.now += cost.step_seconds(len(batch), len(admitted))
            _frames(batch, clock.now, scheduler)
            _deliver(batch, clock.now)
        else:
            clock.now += cost.frame_seconds(len(batch), len(admitted))
            _frames(batch, clock.now, scheduler)
            due = _due(batch, clock.now, chunks, first_chunk_frames, chunk_frames, busy_batch)
            due += [r for r in held if r.pending]
            clock.now += cost.decode_seconds([r.pending for r in due])
            _deliver(due, clock.now)
        finished += scheduler.take_finished()
    return finished


def _frames(batch: list[SimRequest], now: float, scheduler: Scheduler) -> None:
    """One frame made for each request of the step; a request at its length ends."""
    for request in batch:
        request.frames += 1
        if request.first_audio_at is None:
            request.first_audio_at = now
        if request.frames == request.arrival.frames:
            scheduler.finish(request, "length")


def _due(batch: list[SimRequest], now: float, chunks: str, first_frames: int, largest: int,
         busy_batch: int | None) -> list[SimRequest]:
    """The stepped requests whose chunk is due under the engine's schedule (an ended one flushes)."""
    def due(r: SimRequest) -> int:
        first = first_chunk(first_frames, len(batch), busy_batch, r.interactive)
        if chunks == "fixed":
            return fixed_chunk(r.decoded_frames, first, first_frames, largest)
        return lead_chunk(r.decoded_frames, lead(r, now) if r.decoded_frames else 0.0, first, largest)

    return [r for r in batch if r.done or r.pending >= due(r)]


def _deliver(requests: list[SimRequest], now: float) -> None:
    """The audio of each request's frames made so far is out now."""
    for request in requests:
        request.delivered += [now] * request.pending
        request.decoded_frames = request.frames


def _next_event(now: float, pending: deque[Arrival], requests: list[SimRequest], release: float | None) -> float:
    """The next arrival, text token or release from the lead target (`Scheduler.next_release`)."""
    times = [pending[0].at] if pending else []
    times += [] if release is None else [release]
    times += [t for r in requests for t in r.arrival.text_times if t > now]
    if not times:
        raise RuntimeError("the simulation is stuck: nothing can run and nothing will arrive")
    return min(times)


def poisson_workload(rate: float, duration: float, seed: int, streaming_text: bool = False,
                     tokens_per_second: tuple[float, float] = (20.0, 80.0)) -> list[Arrival]:
    """Poisson arrivals with 2-12 s utterances (mean ~6 s), as in scripts/bench_engine.py. With streaming text the
    text comes like an LLM's: first token after 100-300 ms, then 20-80 tokens/s (each gap within +-50% of the
    mean) in random pieces of 1-4 tokens, one token per ~3 frames of speech."""
    rng = random.Random(seed)
    return [_utterance(rng, t, streaming_text, tokens_per_second) for t in poisson_times(rng, rate, duration)]


def burst_workload(sessions: int, seed: int, tokens_per_second: tuple[float, float] = (20.0, 80.0),
                   connect_s: float = 0.05) -> list[Arrival]:
    """`sessions` voice-chat sessions opened in the same instant (a server's start, a reconnect storm): each opens
    within `connect_s`, then its first answer streams like an LLM's (`poisson_workload`'s text), 2-12 s of speech."""
    rng = random.Random(seed)
    return [_utterance(rng, rng.uniform(0.0, connect_s), True, tokens_per_second) for _ in range(sessions)]


def _utterance(rng: random.Random, at: float, streaming_text: bool,
               tokens_per_second: tuple[float, float]) -> Arrival:
    """One request arriving `at`: 2-12 s of speech, its text all at once or streamed like an LLM's."""
    frames = round(min(12.0, max(2.0, rng.gauss(6.0, 2.5))) / FRAME_SECONDS)
    times: tuple[float, ...] = ()
    if streaming_text:
        times = llm_token_times(rng, at, math.ceil(frames / 3), rng.uniform(*tokens_per_second))
    return Arrival(at, frames, times)


def poisson_times(rng: random.Random, rate: float, duration: float) -> Iterator[float]:
    """The arrival times in [0, duration) of a Poisson process of `rate` per second (exponential gaps), drawn lazily
    from `rng` so that a caller may draw its own values between arrivals."""
    t = rng.expovariate(rate)
    while t < duration:
        yield t
        t += rng.expovariate(rate)


def llm_token_times(rng: random.Random, start: float, tokens: int, rate: float) -> tuple[float, ...]:
    times, clock = [], start + rng.uniform(0.1, 0.3)
    while len(times) < tokens:
        piece = min(rng.randint(1, 4), tokens - len(times))
        times += [clock] * piece
        clock += piece / rate * rng.uniform(0.5, 1.5)
    return tuple(times)


def summarize(requests: list[SimRequest]) -> dict:
    """Time to first audio out (from the request or its first text token), the share of requests that never ran
    dry, and throughput: seconds of audio out per second from the first arrival to the last audio."""
    ttfa = sorted(r.delivered[0] - r.started_at for r in requests)
    span = max(r.delivered[-1] for r in requests) - min(r.arrival.at for r in requests)

    def percentile(p: float) -> float:
        return ttfa[min(len(ttfa) - 1, int(p / 100 * len(ttfa)))] * 1e3

    return dict(requests=len(requests), ttfa_ms_p50=percentile(50), ttfa_ms_p95=percentile(95),
                ttfa_ms_p99=percentile(99), never_underrun=sum(r.never_underran() for r in requests) / len(requests),
                audio_s_per_s=sum(r.frames for r in requests) * FRAME_SECONDS / span)
