"""The engine process's audio to the gateway through shared memory, so that the pipe carries only small messages.

Why: pickled through the pipe, a busy step's audio (256 streams: ~2 MB of float32 a step) is read by the parent's
reader thread in socket-buffer pieces, each needing the parent's GIL back from its event loop, and the child's send
waits for all of them: in a burst of sessions that was milliseconds of every step (docs/benchmarks.md, "Where a
burst's time goes"). Here the child copies a message's samples into a ring of shared memory, one after another, and
sends where they lie (`RingSlice`) with each chunk's sample count in place of its samples; the parent's reader copies
them out in one memcpy as it receives the message (each chunk a view of that copy) and marks them read in the ring's
header. The child writes only over what the parent has read; when the ring is full (the parent far behind) the
samples travel in the message as before, so nothing waits and nothing is lost.
"""
from __future__ import annotations

from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from engine.request import AudioChunk, Event

RING_BYTES = 32 << 20  # ~16 steps of 256 streams' one-frame chunks in float32
HEADER_BYTES = 64  # [0:8]: the bytes the reader has taken so far (int64), written by the reader alone
ALIGN = 64


@dataclass(frozen=True)
class RingSlice:
    """Where a message's samples lie in the ring: `count` float32 from byte `offset`; `end` is the writer's running
    total once they are written (the reader's new mark once it has taken them)."""
    offset: int
    count: int
    end: int


class AudioRing:
    def __init__(self, memory: shared_memory.SharedMemory, owner: bool) -> None:
        self.memory, self.owner = memory, owner
        self.capacity = memory.size - HEADER_BYTES
        self._taken = np.ndarray((1,), dtype=np.int64, buffer=memory.buf)  # the reader's mark
        self._data = np.ndarray((self.capacity,), dtype=np.uint8, buffer=memory.buf, offset=HEADER_BYTES)
        self._written = 0  # the writer's running total of bytes placed (skipped tails included)

    @classmethod
    def create(cls, size: int = RING_BYTES) -> AudioRing:
        """The parent's ring (it unlinks it on `close`)."""
        ring = cls(shared_memory.SharedMemory(create=True, size=HEADER_BYTES + size), owner=True)
        ring._taken[0] = 0
        return ring

    @classmethod
    def attach(cls, name: str) -> AudioRing:
        """The child's view of the parent's ring; the parent alone unlinks it (a spawned child shares the parent's
        resource tracker, so the name it registers again is the parent's one entry)."""
        return cls(shared_memory.SharedMemory(name=name), owner=False)

    @property
    def name(self) -> str:
        return self.memory.name

    # --- the writer (the engine process) -----------------------------------------------------------------------

    def put(self, pieces: list[np.ndarray]) -> RingSlice | None:
        """Copy float32 pieces into the ring, one after another; None if they do not fit beside what the reader
        has not taken."""
        count = sum(piece.size for piece in pieces)
        padded = -(-count * 4 // ALIGN) * ALIGN
        start = self._written % self.capacity
        skip = self.capacity - start if start + padded > self.capacity else 0  # never wrap inside a message
        end = self._written + skip + padded
        if padded > self.capacity or end - int(self._taken[0]) > self.capacity:
            return None
        offset = (start + skip) % self.capacity
        if pieces:
            np.concatenate(pieces, out=self._data[offset:offset + count * 4].view(np.float32), casting="same_kind")
        self._written = end
        return RingSlice(offset, count, end)

    def outgoing(self, events: list[Event]) -> tuple[list[Event], RingSlice | None]:
        """A message's events and where their samples lie: each chunk's samples are replaced by their count, all
        of them in the ring in the events' order; (the events as they are, None) if they do not fit."""
        pieces = [event.samples for event in events if isinstance(event, AudioChunk)]
        place = self.put(pieces) if pieces else None
        if place is None:
            return events, None
        return [AudioChunk(e.request_id, e.start_sample, e.samples.size) if isinstance(e, AudioChunk) else e
                for e in events], place

    # --- the reader (the gateway's process) --------------------------------------------------------------------

    def take(self, place: RingSlice) -> np.ndarray:
        """A copy of the samples at `place`, which the writer may then reuse (slices are taken in the order put)."""
        samples = self._data[place.offset:place.offset + place.count * 4].view(np.float32).copy()
        self._taken[0] = place.end
        return samples

    def incoming(self, events: list[Event], place: RingSlice | None) -> list[Event]:
        """A message's events with their samples: one copy out of the ring, each chunk a view of it."""
        if place is None:
            return events
        samples, at = self.take(place), 0
        out: list[Event] = []
        for event in events:
            if isinstance(event, AudioChunk):
                event, at = AudioChunk(event.request_id, event.start_sample, samples[at:at + event.samples]), \
                    at + event.samples
            out.append(event)
        return out

    def close(self) -> None:
        self._taken = self._data = None  # the views first: the buffer cannot close under them
        self.memory.close()
        if self.owner:
            self.memory.unlink()
