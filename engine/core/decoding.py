"""From frames to audio: the chunk schedule, the decodes queued for the requests whose chunk is due, their delivery
as events (a request's Finished after its last chunk), and the start of a slot's codec decoder.

The first chunk comes after `first_chunk_frames` frames for the shortest time to first audio (one frame more for a
one-shot request in a busy step: `first_chunk`), larger ones later to amortise the decoder. Two schedules
(`CHUNK_SCHEDULES`):
- `fixed` (the default): 1, 1, 2, 4, ... frames up to `chunk_frames`, whatever the client holds (`chunk_due`).
- `lead`: by the request's lead, the audio delivered beyond what a client playing since its first audio has heard
  (`lead_chunk`): a chunk of n frames waits for n frame steps, at most one frame of audio each (real time), so it
  waits for n frames only while they fit `LEAD_MARGIN` times into the lead; a thin buffer gets 1-frame chunks, a
  deep one `chunk_frames`. Its lengths are powers of two and `chunk_frames` (`lead_chunk_lengths`): few graphs.
On a GPU the decodes run beside the next step's frame (`decode_overlap.py`); the per-slot decoder states and their
batched, graphed decode are `codec_decoding.py`'s.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from engine.core.codec_decoding import DecoderPool
from engine.core.decode_overlap import DecodeOverlap, PendingAudio
from engine.core.isolation import isolated
from engine.core.scheduler import FRAME_SECONDS, lead
from engine.core.sequence import Sequence
from engine.errors import VoxgateError
from engine.model.codec_decoder import CodecDecoder
from engine.request import AudioChunk, Event, Finished

CHUNK_SCHEDULES = ("fixed", "lead")
# A chunk of n frames is due only while n frames fit into the lead this many times. 1: a step below real time makes
# a frame in less than a frame of audio, so the buffer outlasts the chunk's n steps; the rule is read again each
# step, so a chunk shrinks as the lead falls. (2 kept leads safer but cost more decodes: less throughput near
# capacity in the simulator.)
LEAD_MARGIN = 1.0


def first_chunk(first_chunk_frames: int, batch: int, busy_batch: int | None, interactive: bool) -> int:
    """The frames a request's first chunk waits for in a step of `batch` requests: `first_chunk_frames`, one more for
    a one-shot request while the step is busy (more than `busy_batch` requests; None: never). A one-frame start
    leaves a client that plays at once 80 ms of audio to read the next chunk in; a busy engine sends it a longer step
    later, and a client streaming many responses reads it later still (its loop stalls: tts_bench's underruns at
    60-100 req/s came there). A second frame doubles that slack for one step of time to first audio. An interactive
    request (a conversation's WebSocket context) keeps the one-frame start: its player buffers (the demo's 80 ms),
    and a burst of sessions would wait a long step more for every first audio."""
    busy = busy_batch is not None and batch > busy_batch and not interactive
    return first_chunk_frames + 1 if busy else first_chunk_frames


def fixed_chunk(decoded_frames: int, first: int, first_chunk_frames: int, chunk_frames: int) -> int:
    """The `fixed` schedule: the first chunk is `first` frames (`first_chunk`); later ones grow with the audio out
    (1, 1, 2, 4, ... frames up to `chunk_frames`), each due before the audio in front of it has played, the decoder's
    fixed cost amortised as the buffer grows. A busy step lengthens only the first."""
    if decoded_frames == 0:
        return first
    return min(chunk_frames, max(first_chunk_frames, decoded_frames))


def later_chunk_lengths(chunk_frames: int) -> tuple[int, ...]:
    """The lengths of `lead_chunk`'s chunks after the first: the powers of two below `chunk_frames`, and it."""
    return tuple(sorted({chunk_frames, *(1 << k for k in range(chunk_frames.bit_length()) if 1 << k < chunk_frames)}))


def lead_chunk_lengths(first_chunk_frames: int, chunk_frames: int) -> tuple[int, ...]:
    """Every length `lead_chunk` returns (the decoder graphs to capture)."""
    return tuple(sorted({first_chunk_frames, *later_chunk_lengths(chunk_frames)}))


def lead_chunk(decoded_frames: int, lead_s: float, first_chunk_frames: int, chunk_frames: int) -> int:
    """The frames the next chunk waits for, given the audio already out and the lead (seconds of it not yet played):
    the first chunk is `first_chunk_frames` (time to first audio), then the longest length whose frames, made at
    real time at worst, fit `LEAD_MARGIN` times into the lead: short chunks while the client's buffer is thin, up to
    `chunk_frames` once it is deep (the decoder's fixed cost amortised)."""
    if decoded_frames == 0:
        return first_chunk_frames
    fits = lead_s / (LEAD_MARGIN * FRAME_SECONDS)
    return max(n for n in later_chunk_lengths(chunk_frames) if n <= max(1.0, fits))


class Decoding:
    def __init__(self, decoder: CodecDecoder, slots: int, device: torch.device, dtype: torch.dtype,
                 first_chunk_frames: int, chunk_frames: int, overlap: bool, capture: bool,
                 fail: Callable[[Sequence, VoxgateError], None], schedule: str = "fixed",
                 clock: Callable[[], float] | None = None, busy_batch: int | None = None) -> None:
        """`capture`: CUDA graphs of the decoder; `fail`: how a request whose decode raises alone ends; `schedule`:
        one of `CHUNK_SCHEDULES`; `clock`: seconds, as the scheduler's (the `lead` schedule reads it); `busy_batch`:
        one-shot requests' first chunks are a frame longer in a step of more requests (`first_chunk`)."""
        if first_chunk_frames < 1 or chunk_frames < 1:
            raise ValueError("first_chunk_frames and chunk_frames must be at least 1")
        if busy_batch is not None and (busy_batch < 0 or first_chunk_frames >= chunk_frames):
            raise ValueError("busy_batch must be at least 0, with first_chunk_frames below chunk_frames")
        if schedule not in CHUNK_SCHEDULES:
            raise ValueError(f"unknown chunk schedule {schedule!r}; choose one of {', '.join(CHUNK_SCHEDULES)}")
        if schedule == "lead" and clock is None:
            raise ValueError("the lead chunk schedule needs a clock")
        self.first_chunk_frames, self.chunk_frames = first_chunk_frames, chunk_frames
        self.schedule, self.clock, self.busy_batch = schedule, clock, busy_batch
        self.samples_per_frame = decoder.samples_per_frame
        self.overlap = DecodeOverlap(device, overlap)
        self.decoders = DecoderPool(decoder, slots, device, dtype, capture=capture,
                                    chunk_lengths=self.chunk_lengths())
        self.in_flight: list[PendingAudio] = []  # decoded chunks not yet delivered, in the order queued
        self.finishing: list[Sequence] = []  # ended requests whose Finished waits for their audio in flight
        self.queued_steps = 0  # `queue` calls so far: the `step` of the latest PendingAudio
        self._fail = fail

    def chunk_due(self, decoded_frames: int, first: int) -> int:
        """The `fixed` schedule's next chunk (`fixed_chunk`) after a `first`-frame start."""
        return fixed_chunk(decoded_frames, first, self.first_chunk_frames, self.chunk_frames)

    def first_chunks(self) -> tuple[int, ...]:
        """The lengths a first chunk may have: `first_chunk_frames`, and one more with a `busy_batch`."""
        batches = (0,) if self.busy_batch is None else (0, self.busy_batch + 1)
        return tuple(sorted({first_chunk(self.first_chunk_frames, batch, self.busy_batch, False)
                             for batch in batches}))

    def chunk_lengths(self) -> tuple[int, ...]:
        """Every chunk length the schedule produces (a final flush may be shorter)."""
        if self.schedule == "lead":
            firsts = self.first_chunks()
            return tuple(sorted({n for first in firsts for n in lead_chunk_lengths(first, self.chunk_frames)}))
        lengths: set[int] = set()
        for first in self.first_chunks():
            length, decoded = 0, 0
            while length < self.chunk_frames:
                length = self.chunk_due(decoded, first)
                lengths.add(length)
                decoded += length
        return tuple(sorted(lengths))

    def start(self, seqs: list[Sequence]) -> None:
        """Fresh decoder states for newly admitted requests."""
        with self.overlap.context():  # after any decode still queued for the slot's previous request
            self.decoders.reset([seq.slot for seq in seqs])
            for seq in seqs:
                ref_codes = seq.request.voice.ref_codes
                if ref_codes is not None and ref_codes.shape[0]:
                    # Voice cloning: the reference frames are the decoder's left context, never heard.
                    self.decoders.prime(seq.slot, ref_codes)

    def queue(self, stepped: list[Sequence], held: list[Sequence]) -> None:
        """Queue the decoding of every request whose next chunk is due, batching those with the same chunk length;
        a held request's frames are due at once. A chunk whose length has no decoder graph goes as pieces that have
        one, in order. A batch that raises is retried in halves down to single requests: the decoder's state is only
        written back once a decode has run, and only a request that fails alone ends."""
        due = self._due(stepped) + [s for s in held if s.pending]
        due.sort(key=lambda seq: seq.decoded_frames > 0)  # first chunks first: a step waits for them alone
        pieces = {seq: self.decoders.pieces(len(seq.pending)) for seq in due}
        with self.overlap.context():
            for piece in range(max(map(len, pieces.values()), default=0)):
                groups: dict[int, list[Sequence]] = {}  # length -> the requests whose piece has that length
                for seq, lengths in pieces.items():
                    if piece < len(lengths) and seq.error is None:
                        groups.setdefault(lengths[piece], []).append(seq)
                for length, group in groups.items():
                    offset = {seq: sum(pieces[seq][:piece]) for seq in group}
                    isolated(group, partial(self._decode, offset=offset, length=length), "decoding its audio",
                             self._fail)
        for seq in due:
            seq.decoded_frames += len(seq.pending)
            seq.pending.clear()
        self.queued_steps += 1

    def _due(self, stepped: list[Sequence]) -> list[Sequence]:
        """The stepped requests whose chunk is due (or that ended with frames to flush)."""
        def first(seq: Sequence) -> int:
            return first_chunk(self.first_chunk_frames, len(stepped), self.busy_batch, seq.interactive)

        if self.schedule == "fixed":
            return [s for s in stepped
                    if s.pending and (len(s.pending) >= self.chunk_due(s.decoded_frames, first(s)) or s.done)]
        now, largest = self.clock(), self.chunk_frames
        return [s for s in stepped if s.pending and (s.done or len(s.pending) >= lead_chunk(
            s.decoded_frames, lead(s, now) if s.decoded_frames else 0.0, first(s), largest))]

    def _decode(self, seqs: list[Sequence], offset: dict[Sequence, int], length: int) -> None:
        """Queue the decoding of frames offset[s]..offset[s]+length of each request's pending frames."""
        codes = torch.from_numpy(np.array([s.pending[offset[s]:offset[s] + length] for s in seqs]))  # [B, n, 16]
        audio = self.decoders.decode([s.slot for s in seqs], codes)
        owners = [(s, (s.decoded_frames + offset[s]) * self.samples_per_frame) for s in seqs]
        pending = self.overlap.to_host(owners, audio)
        pending.step = self.queued_steps + 1
        self.in_flight.append(pending)

    def through_step(self, step: int) -> int:
        """How many decodes in flight (the oldest first) were queued by steps up to `step`."""
        return sum(pending.step <= step for pending in self.in_flight)

    def through_first_audio(self) -> int:
        """How many decodes in flight (the oldest first) end with the last that holds a request's first chunk (0:
        none): what a step waits for at once. A step queues its first chunks before its other chunks, so a
        newcomer's first audio does not wait for the larger chunks decoded in the same step."""
        return max((index + 1 for index, pending in enumerate(self.in_flight)
                    if any(start == 0 for _, start in pending.owners)), default=0)

    def collect(self, finished: list[Sequence], wait_for: int) -> list[Event]:
        """Deliver, in the order queued, the first `wait_for` decodes in flight (waiting for them if needed) and
        every later one whose copy has already landed (polled); then the Finished of each ended request (`finished`
        joins those kept from before) whose audio is all out."""
        events: list[Event] = []
        delivered = 0
        for index, pending in enumerate(self.in_flight):
            if index >= wait_for and not pending.landed():
                break  # one stream: the later chunks have not landed either
            for (seq, start_sample), samples in zip(pending.owners, pending.wait()):
                if not seq.cancelled:
                    events.append(AudioChunk(seq.request_id, start_sample, samples))
            delivered += 1
        del self.in_flight[:delivered]
        still_decoding = {seq for pending in self.in_flight for seq, _ in pending.owners}
        self.finishing += finished
        events += [Finished(s.request_id, s.done, s.frames, s.error) for s in self.finishing
                   if s not in still_decoding and not s.cancelled]
        self.finishing = [s for s in self.finishing if s in still_decoding]
        return events
