"""Which requests run: the waiting queue, the running requests and their slots, admission, the hold rule, which
runnable requests take the next frame step, and the bookkeeping of a request's end.

Admission takes waiting requests in turns by owner (the client that asks: a session, an API key), the owner with
the fewest running requests first and each owner's oldest first, up to `max_prefill_batch` per step and while slots
are free: a client with many requests queued cannot keep another's first request waiting behind them all. A
streaming-text request waits until its prefill has its text (`Sequence.ready`). The last `reserved_slots` free slots
(and as many places of the waiting room) are for interactive requests (a conversation's WebSocket contexts): a
one-shot request (HTTP) passes them by, so that a burst of one-shot requests cannot make a conversation wait for a
slot; the waiting interactive requests behind it take them. An owner that holds half the slots leaves the last
quarter of the free slots (`spare_slots`) to other owners: turns only share the slots that free, and a client whose
many long requests filled every slot (a hostile try: 8 contexts of 20,000 characters that it never read) would
keep every other client waiting until one of them ended. A request whose owner already runs one leaves the reserve
too, so that several clients that fill their shares (two sessions of 8 long contexts each, a hostile try) still
leave a newcomer's first request a slot; it costs a sixteenth of the slots, and only while owners that each run
several requests fill the engine. A running request whose next text token has not arrived
holds (`Sequence.runnable`); the others are runnable.

When more are runnable than a step holds (`max_step_batch`), a request's urgency is its playback deadline: how much
of its audio is still ahead of a client that started playing at its first audio. A new request ranks before every
request with more than half a second of audio buffered: its first audio comes in the next step unless running
requests are about to run dry. Requests far ahead of real time are the ones left out when the step is full.

A lead target (`lead_target_s`; off by default here, 1 s on a GPU by the gateway's default) holds an interactive
request whose audio is that far ahead of its client's playback while the engine is busy (more than `busy_rows`
requests run) and no ready request waits for a slot: in a burst
the engine makes hundreds of streams' audio several times faster than real time, and the gateway's one event loop,
busy with audio seconds ahead of its players, makes the newcomers' first audio wait (docs/benchmarks.md, tenth
session). Held there, a stream makes audio at real time; once a request waits for a slot every stream runs ahead
again, to end and free its slot sooner, and a stream on a quiet engine runs ahead as fast as it can (a client that
saves the audio, not only plays it). `next_release` says when the first held one falls below the target.

Policies are named, so that the engine, the simulator (`engine/core/simulator.py`) and the benchmarks choose them by
name; each orders the runnable requests and the step takes the first `max_step_batch`:
- `deadline`: least audio buffered ahead of playout first; a new request ranks as if it had 0.5 s buffered, so
  under overload it waits for the running requests to have audio to spare instead of making them all run dry.
- `fcfs`: first come, first served (arrival order): the baseline the simulator compares against.

Admission (`ADMISSIONS`):
- `all` (the default): every ready waiting request, up to `max_prefill_batch`, in the next step's prefill.
- `protect`: a prefill makes the step longer for every running request, so it only runs when the thinnest lead
  among the runnable requests that have audio out (`lead`: delivered audio not yet played) covers a loaded frame step
  (`PROTECT_STEP_S`) plus the prefill (`PREFILL_PASS_S` + `PREFILL_PER_REQUEST_S` per request): the batch is cut to
  what fits, or deferred. A held request is not counted (it waits for text, not for the GPU). A request ready for
  `MAX_ADMISSION_WAIT_S` is admitted whatever the leads: no starvation, and a bound on what protection adds to time
  to first audio.

The simulator runs this same class on a virtual clock (`clock`), with its own requests behind the `Scheduled` rules.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import torch

from engine.core.sequence import Sequence
from engine.errors import EngineFull

FRAME_SECONDS = 0.08  # 12.5 frames per second
NEW_REQUEST_SLACK_S = 0.5
ADMISSIONS = ("all", "protect")
# `protect`: the simulator's cost model (H100, 1.7B): a prefill pass and its cost per request, a frame step at 256
# requests with their decoding (47 ms; the real engine is slower under load); the longest a ready request waits.
PREFILL_PASS_S = 0.010
PREFILL_PER_REQUEST_S = 0.0005
PROTECT_STEP_S = 0.05
MAX_ADMISSION_WAIT_S = 0.1
RESERVED_SLOT_SHARE = 16  # of the slots, kept for interactive requests
ROUNDING_S = 1e-9  # a lead within this of the lead target is at it


def spare_slots(slots: int) -> int:
    """Free slots an owner holding half the slots leaves to other owners: a quarter, at least one (none for an engine
    of one slot)."""
    return 0 if slots < 2 else max(1, slots // 4)


def reserved_slots(slots: int) -> int:
    """Free slots (and waiting places) a one-shot request leaves to interactive ones: a sixteenth, at least one (none
    for an engine of one slot)."""
    return 0 if slots < 2 else max(1, slots // RESERVED_SLOT_SHARE)


class Scheduled(Protocol):
    request_id: int  # increases with arrival
    slot: int
    frames: int  # frames generated so far
    decoded_frames: int  # frames whose audio is out (queued for decoding)
    first_audio_at: float | None  # when its first frame was generated
    done: str | None
    interactive: bool  # False: a one-shot request, which leaves the reserved slots free
    owner: str | None  # who asks: waiting requests take turns by owner (None: a client of its own)

    def ready(self) -> bool: ...  # its prefill can run

    def runnable(self) -> bool: ...  # its next frame can run


def buffered_ahead(seq: Scheduled, now: float) -> float:
    """Seconds of audio generated beyond what a client playing since the first audio has heard."""
    return seq.frames * FRAME_SECONDS - (now - seq.first_audio_at)


def lead(seq: Scheduled, now: float) -> float:
    """Seconds of audio delivered beyond what a client playing since the first audio has heard: what it can play
    before it runs dry."""
    return seq.decoded_frames * FRAME_SECONDS - (now - seq.first_audio_at)


def _at_target(seq: Scheduled, now: float, target: float | None) -> bool:
    """An interactive request with its audio more than `target` seconds ahead of its client's playback (by more than
    rounding: at its `next_release` it steps)."""
    return target is not None and seq.interactive and seq.first_audio_at is not None \
        and buffered_ahead(seq, now) > target + ROUNDING_S


def prefill_seconds(requests: int) -> float:
    """What a prefill of `requests` adds to a step (`protect`'s estimate)."""
    return PREFILL_PASS_S + requests * PREFILL_PER_REQUEST_S if requests else 0.0


def playback_deadline(seq: Scheduled, now: float) -> float:
    """A new request ranks as if `NEW_REQUEST_SLACK_S` of its audio were buffered: before every running request that
    has more (time to first audio), after those about to run dry (a newcomer never makes others underrun)."""
    return NEW_REQUEST_SLACK_S if seq.first_audio_at is None else buffered_ahead(seq, now)


S = TypeVar("S", bound=Scheduled)
Order = Callable[[Scheduled, float], float]
POLICIES: dict[str, Order] = {
    "deadline": playback_deadline,
    "fcfs": lambda seq, now: seq.request_id,
}


class Scheduler(Generic[S]):
    def __init__(self, slots: int, policy: str = "deadline", max_step_batch: int | None = None,
                 max_prefill_batch: int = 64, max_waiting: int | None = None,
                 clock: Callable[[], float] = time.monotonic, admission: str = "all",
                 lead_target_s: float | None = None, busy_rows: int = 0) -> None:
        """`max_waiting`: None queues without limit (the simulator); `clock`: seconds, for deadlines and first audio;
        `admission`: one of `ADMISSIONS`; `lead_target_s`: the lead target in seconds (module docstring), or None;
        `busy_rows`: it holds only while more requests than this run."""
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if admission not in ADMISSIONS:
            raise ValueError(f"unknown admission {admission!r}; choose one of {', '.join(ADMISSIONS)}")
        if max_step_batch is not None and max_step_batch < 1:
            raise ValueError("max_step_batch must be at least 1")
        if lead_target_s is not None and not lead_target_s > 0:
            raise ValueError("the lead target must be a positive number of seconds")
        self.lead_target_s = lead_target_s
        self.busy_rows = busy_rows
        self.max_step_batch = max_step_batch
        self.max_prefill_batch = max_prefill_batch
        self.max_waiting = max_waiting
        self.clock = clock
        self._order = POLICIES[policy]
        self.admission = admission
        self.ready_since: dict[int, float] = {}  # `protect`: request id -> when it was first seen ready
        self.slots = slots
        self.free_slots = list(range(slots))
        self.reserved = reserved_slots(slots)
        self.spare = spare_slots(slots)
        self.held: Counter[str] = Counter()  # owner -> its running requests
        self.waiting: deque[S] = deque()
        self.running: dict[int, S] = {}
        self.finished: list[S] = []  # ended requests whose Finished is not delivered yet

    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.finished

    def check_room(self, interactive: bool = True) -> None:
        """Raises EngineFull when the waiting queue is full, for a one-shot request `reserved` places before (before
        a request is planned: that costs)."""
        if self.max_waiting is None:
            return
        if len(self.waiting) >= self.max_waiting - (0 if interactive else self.reserved):
            raise EngineFull(f"the engine is full ({len(self.waiting)} requests waiting); try again later")

    def add(self, seq: S) -> None:
        self.waiting.append(seq)

    def find(self, request_id: int) -> S | None:
        """A running or waiting request."""
        return self.running.get(request_id) or next((s for s in self.waiting if s.request_id == request_id), None)

    def admit(self, prepare: Callable[[S], bool]) -> list[S]:
        """The waiting requests that can start now, oldest first, each moved to a slot. `prepare(seq)` completes a
        ready request before it takes a slot (the engine builds a streaming-text prompt); False leaves it out. Under
        `protect` a request may be deferred (module docstring)."""
        if self.admission == "protect" and self.waiting:
            return self._admit_protecting(prepare)
        admitted: list[S] = []
        for seq in self._in_turns():
            if len(admitted) >= self.max_prefill_batch or not self.free_slots:
                break
            if not seq.ready() or not self._slot_for(seq) or not prepare(seq):
                continue
            self._start(seq)
            admitted.append(seq)
        return admitted

    def _in_turns(self) -> list[S]:
        """The waiting requests in admission order: an owner's k-th oldest ready request ranks as if its owner ran k
        more requests than it does, ties oldest first, so owners take turns, the least served first (a request
        without owner: an owner of its own, running nothing). A request not ready yet takes no turn of its owner's."""
        queued: Counter[str] = Counter()
        ranked = []
        for arrival, seq in enumerate(self.waiting):
            turn = 0
            if seq.owner is not None:
                turn = self.held[seq.owner] + queued[seq.owner]
                queued[seq.owner] += seq.ready()
            ranked.append((turn, arrival, seq))
        return [seq for _, _, seq in sorted(ranked, key=lambda entry: entry[:2])]

    def admissible(self) -> bool:
        """Whether a waiting request could start now (`protect` aside): ready, with a slot free for it."""
        return any(seq.ready() and self._slot_for(seq) for seq in self.waiting)

    def _slot_for(self, seq: S) -> bool:
        """Whether a slot is free for `seq`: a one-shot request, or one whose owner already runs one, leaves the last
        `reserved` free slots (a newcomer's first request finds one however many clients fill their shares), a
        request whose owner holds half the slots the last `spare`."""
        held = self.held[seq.owner] if seq.owner is not None else 0
        keep = self.reserved if not seq.interactive or held else 0
        if 2 * held >= self.slots:
            keep = max(keep, self.spare)
        return len(self.free_slots) > keep

    def _admit_protecting(self, prepare: Callable[[S], bool]) -> list[S]:
        """`protect`: the oldest ready requests whose prefill the thinnest lead can pay for, and every overdue one."""
        now = self.clock()
        budget = self.thinnest_lead(now) - PROTECT_STEP_S
        admitted: list[S] = []
        for seq in self._in_turns():
            if len(admitted) >= self.max_prefill_batch or not self.free_slots:
                break
            if not seq.ready() or not self._slot_for(seq):
                continue
            since = self.ready_since.setdefault(seq.request_id, now)
            if now - since < MAX_ADMISSION_WAIT_S and prefill_seconds(len(admitted) + 1) > budget:
                continue
            if not prepare(seq):
                continue
            self._start(seq)
            admitted.append(seq)
        return admitted

    def thinnest_lead(self, now: float) -> float:
        """The smallest lead among the runnable requests with audio out (infinite if none): what a longer step eats."""
        leads = [lead(s, now) for s in self.running.values() if s.decoded_frames and s.runnable()]
        return min(leads, default=float("inf"))

    def _start(self, seq: S) -> None:
        """Move a waiting request to a free slot."""
        self.waiting.remove(seq)
        self.ready_since.pop(seq.request_id, None)
        seq.slot = self.free_slots.pop(0)
        self.running[seq.request_id] = seq
        if seq.owner is not None:
            self.held[seq.owner] += 1

    def _release(self, request_id: int) -> S | None:
        """Take a request out of the running ones, if it runs: its slot is free."""
        seq = self.running.pop(request_id, None)
        if seq is not None:
            self.free_slots.append(seq.slot)
            if seq.owner is not None:
                self.held[seq.owner] -= 1
                if not self.held[seq.owner]:
                    del self.held[seq.owner]
        return seq

    def schedule(self) -> tuple[list[S], list[S]]:
        """(the requests of the next frame step, most urgent first; the held ones: waiting for text, or at the lead
        target)."""
        now = self.clock()
        target = self._lead_target()
        runnable: list[S] = []
        held: list[S] = []
        for seq in self.running.values():
            (runnable if seq.runnable() and not _at_target(seq, now, target) else held).append(seq)
        return self.select(runnable, now), held

    def steppable(self) -> bool:
        """Whether a running request would step now (its text is in, it is not held at the lead target)."""
        now, target = self.clock(), self._lead_target()
        return any(seq.runnable() and not _at_target(seq, now, target) for seq in self.running.values())

    def next_release(self) -> float | None:
        """When (the clock's seconds) the first request held only by the lead target falls below it; None if none."""
        now, target = self.clock(), self._lead_target()
        return min((seq.first_audio_at + seq.frames * FRAME_SECONDS - target for seq in self.running.values()
                    if seq.runnable() and _at_target(seq, now, target)), default=None)

    def _lead_target(self) -> float | None:
        """The lead target in force: none on a quiet engine, nor while a ready request waits for a slot."""
        quiet = len(self.running) <= self.busy_rows
        if self.lead_target_s is None or quiet or any(seq.ready() for seq in self.waiting):
            return None
        return self.lead_target_s

    def select(self, runnable: list[S], now: float) -> list[S]:
        """The requests of the next step, most urgent first."""
        if self.max_step_batch is None or len(runnable) <= self.max_step_batch:
            return list(runnable)
        return sorted(runnable, key=lambda seq: self._order(seq, now))[: self.max_step_batch]

    def postprocess(self, seqs: list[Sequence], codes: torch.Tensor, eos: int) -> None:
        """Each request's new frame (codes [B, 16] on the host): EOS or its last frame ends it."""
        for seq, frame in zip(seqs, codes.numpy()):
            if frame[0] == eos:
                self.finish(seq, "eos")
                continue
            seq.pending.append(frame)
            seq.frames += 1
            if seq.first_audio_at is None:
                seq.first_audio_at = self.clock()
            if seq.frames >= seq.max_frames:
                self.finish(seq, "length")

    def finish(self, seq: S, reason: str) -> None:
        """The request is done: its slot is free for the next admission, its Finished is due."""
        seq.done = reason
        if self._release(seq.request_id) is None and seq in self.waiting:
            self.waiting.remove(seq)
            self.ready_since.pop(seq.request_id, None)
        if seq not in self.finished:
            self.finished.append(seq)

    def cancel(self, request_id: int) -> bool:
        """Drop a request now: its slot is free for the next step and it produces no further event."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                self.ready_since.pop(request_id, None)
                return True
        seq = self._release(request_id)
        if seq is None:
            seq = next((s for s in self.finished if s.request_id == request_id), None)
        if seq is None:
            return False
        seq.cancelled = True  # its chunks still in flight are dropped
        return True

    def take_finished(self) -> list[S]:
        """The ended requests whose Finished is due now."""
        finished, self.finished = self.finished, []
        return finished
