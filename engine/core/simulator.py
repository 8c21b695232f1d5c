"""The engine's scheduling on a virtual clock: the real `Scheduler` (admission, hold rule, selection, ends) and a
cost model of the GPU step in place of the model, so that policies are compared in seconds on a CPU (and in CI).

The cost model's defaults are fitted from the H100 1.7B runs in docs/benchmarks.md: a frame step of 6.6 ms at
batch 1 growing ~0.05 ms per request (12.9 ms at 128), codec decoding ~0.11 ms per generated frame (offline, 427
audio s/s at batch 256); a prefill pass of ~10 ms (eager, launch-bound: single-request time to first audio, 23 ms,
less the step and the first decode) plus ~0.5 ms per request in it.

A simulated client starts playing a request's audio at its first frame; a frame generated after its playback time is an
underrun. With streaming text, latency runs from the first text token, and a frame can run only once its text token
has arrived (one token per frame, then the end of the input), as in the engine.
"""
from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

from engine.core.scheduler import FRAME_SECONDS, Scheduler


@dataclass(frozen=True)
class CostModel:
    step_ms: float = 6.6
    per_request_ms: float = 0.05
    decode_per_frame_ms: float = 0.11
    prefill_ms: float = 10.0  # a prefill pass (eager: launch-bound)
    prefill_per_request_ms: float = 0.5

    def step_seconds(self, batch: int, admitted: int) -> float:
        prefill = self.prefill_ms + admitted * self.prefill_per_request_ms if admitted else 0.0
        return (self.step_ms + batch * (self.per_request_ms + self.decode_per_frame_ms) + prefill) / 1e3


@dataclass(frozen=True)
class Arrival:
    at: float
    frames: int
    text_times: tuple[float, ...] = ()  # arrival of each text token (streaming text); empty: all text at `at`


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
    first_audio_at: float | None = None
    done: str | None = None
    delivered: list[float] = field(default_factory=list)

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

    def never_underran(self) -> bool:
        return all(t <= self.first_audio_at + k * FRAME_SECONDS + 1e-9 for k, t in enumerate(self.delivered))


def simulate(arrivals: list[Arrival], scheduler: Scheduler, cost: CostModel = CostModel()) -> list[SimRequest]:
    """Run every arrival to its length through `scheduler` (a new one: its queues empty), which is put on the
    simulation's virtual clock; returns the requests with their frame times."""
    clock = scheduler.clock = VirtualClock()
    pending = deque(sorted(arrivals, key=lambda a: a.at))
    finished: list[SimRequest] = []
    ids = 0
    while pending or not scheduler.idle():
        while pending and pending[0].at <= clock.now:
            ids += 1
            scheduler.add(SimRequest(ids, pending.popleft(), clock))
        admitted = scheduler.admit(lambda request: True)
        batch, _ = scheduler.schedule()
        if not batch and not admitted:
            clock.now = _next_event(clock.now, pending, [*scheduler.waiting, *scheduler.running.values()])
            continue
        clock.now += cost.step_seconds(len(batch), len(admitted))
        for request in batch:
            request.frames += 1
            request.delivered.append(clock.now)
            if request.first_audio_at is None:
                request.first_audio_at = clock.now
            if request.frames == request.arrival.frames:
                scheduler.finish(request, "length")
        finished += scheduler.take_finished()
    return finished


def _next_event(now: float, pending: deque[Arrival], requests: list[SimRequest]) -> float:
    times = [pending[0].at] if pending else []
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
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return arrivals
        frames = round(min(12.0, max(2.0, rng.gauss(6.0, 2.5))) / FRAME_SECONDS)
        times: tuple[float, ...] = ()
        if streaming_text:
            times = llm_token_times(rng, t, math.ceil(frames / 3), rng.uniform(*tokens_per_second))
        arrivals.append(Arrival(t, frames, times))


def llm_token_times(rng: random.Random, start: float, tokens: int, rate: float) -> tuple[float, ...]:
    times, clock = [], start + rng.uniform(0.1, 0.3)
    while len(times) < tokens:
        piece = min(rng.randint(1, 4), tokens - len(times))
        times += [clock] * piece
        clock += piece / rate * rng.uniform(0.5, 1.5)
    return tuple(times)


def summarize(requests: list[SimRequest]) -> dict:
    ttfa = sorted(r.first_audio_at - r.started_at for r in requests)

    def percentile(p: float) -> float:
        return ttfa[min(len(ttfa) - 1, int(p / 100 * len(ttfa)))] * 1e3

    return dict(requests=len(requests), ttfa_ms_p50=percentile(50), ttfa_ms_p95=percentile(95),
                ttfa_ms_p99=percentile(99), never_underrun=sum(r.never_underran() for r in requests) / len(requests))
