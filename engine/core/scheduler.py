"""Which running streams take the next frame step when there are more than a step holds.

A stream's urgency is its playback deadline: how much of its audio is still ahead of a client that started playing
at its first audio. The engine admits (prefills) new requests before it steps, and a new request ranks before every
stream with more than half a second of audio buffered: its first audio comes in the next step unless running
streams are about to run dry. Streams far ahead of real time are the ones left out when the step is full.

Policies are named, so that the engine, the simulator (`engine/core/simulator.py`) and the benchmarks choose them by
name; each orders the runnable streams and the step takes the first `max_step_batch`:
- `deadline`: least audio buffered ahead of playout first; a new request ranks as if it had 0.5 s buffered, so
  under overload it waits for the running streams to have audio to spare instead of making them all run dry.
- `fcfs`: first come, first served (arrival order): the baseline the simulator compares against.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

FRAME_SECONDS = 0.08  # 12.5 frames per second


class Scheduled(Protocol):
    request_id: int  # increases with arrival
    frames: int  # frames generated so far
    first_audio_at: float | None  # when its first frame was generated


NEW_STREAM_SLACK_S = 0.5


def buffered_ahead(stream: Scheduled, now: float) -> float:
    """Seconds of audio generated beyond what a client playing since the first audio has heard."""
    return stream.frames * FRAME_SECONDS - (now - stream.first_audio_at)


def playback_deadline(stream: Scheduled, now: float) -> float:
    """A new request ranks as if `NEW_STREAM_SLACK_S` of its audio were buffered: before every running stream that
    has more (time to first audio), after those about to run dry (a newcomer never makes others underrun)."""
    return NEW_STREAM_SLACK_S if stream.first_audio_at is None else buffered_ahead(stream, now)


S = TypeVar("S", bound=Scheduled)
Order = Callable[[Scheduled, float], float]
POLICIES: dict[str, Order] = {
    "deadline": playback_deadline,
    "fcfs": lambda stream, now: stream.request_id,
}


class Scheduler:
    def __init__(self, policy: str = "deadline", max_step_batch: int | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if max_step_batch is not None and max_step_batch < 1:
            raise ValueError("max_step_batch must be at least 1")
        self.policy = policy
        self.max_step_batch = max_step_batch
        self._order = POLICIES[policy]

    def select(self, runnable: Sequence[S], now: float) -> list[S]:
        """The streams of the next step, most urgent first."""
        if self.max_step_batch is None or len(runnable) <= self.max_step_batch:
            return list(runnable)
        return sorted(runnable, key=lambda stream: self._order(stream, now))[: self.max_step_batch]
