"""The engine process's audio to the gateway through shared memory, so that the pipe carries only small messages.

Why: pickled through the pipe, a busy step's audio (256 streams: ~2 MB of float32 a step) is read by the parent's
reader thread in socket-buffer pieces, each needing the parent's GIL back from its event loop, and the child's send
waits for all of them: in a burst of sessions that was 7-9 ms of every busy step (docs/benchmarks.md, "Where a
burst's time goes"). Here the child copies a message's samples into a ring of shared memory, one after another, and
sends where they lie (`RingSlice`) with each chunk's sample count in place of its samples; the parent's reader copies
each chunk out as it receives the message, then marks the message read in the ring's header. The child writes only
over what the parent has read; when the ring is full (the parent far behind) the samples travel in the message as
before, so nothing waits and nothing is lost. A server whose /dev/shm has no room for the ring sends every message
that way (`ProcessEngine`).
"""
from __future__ import annotations

import os
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
        """The parent's ring. Its pages are reserved now: tmpfs allocates them on first write, and a full /dev/shm
        (a container's 64 MB) would then kill the writer with SIGBUS; here it raises OSError instead (ENOSPC)."""
        memory = shared_memory.SharedMemory(create=True, size=HEADER_BYTES + size)
        reserve = getattr(os, "posix_fallocate", None)  # Linux (where /dev/shm is a tmpfs); not macOS
        try:
            if reserve is not None:
                reserve(memory._fd, 0, memory.size)  # noqa: SLF001 - the segment's file
        except OSError:
            memory.close()
            memory.unlink()
            raise
        ring = cls(memory, owner=True)
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
        """Copy float32 pieces (at least one) into the ring, one after another; None if they do not fit beside what
        the reader has not taken."""
        count = sum(piece.size for piece in pieces)
        padded = -(-count * 4 // ALIGN) * ALIGN
        start = self._written % self.capacity
        skip = self.capacity - start if start + padded > self.capacity else 0  # never wrap inside a message
        end = self._written + skip + padded
        if padded > self.capacity or end - int(self._taken[0]) > self.capacity:
            return None
        offset = (start + skip) % self.capacity
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

    def incoming(self, events: list[Event], place: RingSlice) -> list[Event]:
        """A message's events with their samples, each chunk copied out of the ring on its own (a chunk held by a
        slow listener keeps only its own samples alive); then the ring's space is the writer's again."""
        out: list[Event] = []
        at = place.offset
        for event in events:
            if isinstance(event, AudioChunk):
                size = event.samples * 4
                samples = self._data[at:at + size].view(np.float32).copy()
                event, at = AudioChunk(event.request_id, event.start_sample, samples), at + size
            out.append(event)
        self._taken[0] = place.end
        return out

    def unlink(self) -> None:
        """The parent's: the ring's name goes (its memory stays mapped until `close`); once is enough."""
        if self.owner:
            try:
                self.memory.unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unmap the ring (the name too, for the parent): only once nothing reads it, since the arrays over it
        would read unmapped memory; a second call does nothing."""
        if self._data is None:
            return
        self._taken = self._data = None
        self.memory.close()
        self.unlink()
