"""An encoder process of the gateway's `EncoderPool` (`python -m realtime.audio.encoder_worker`): it holds the
`StreamEncoder`s of the streams given to it and runs their calls one after another (of those waiting, a new stream's
first: `first_audio_first`), so the gateway's event loop never shares a GIL with libopus, soxr and their numpy glue
(one process did ~130 audio s per wall s over many threads on the H100 host: the threads waited for the GIL, not the
CPU; docs/benchmarks.md).

The pipe protocol, both ways a header `<QBI` (stream, op or status, payload length) and the payload:
- `OPEN` (the `AudioFormat` as JSON; `OPEN_CONTINUING` for a stream that goes on from audio already sent), `ENCODE`
  (float32 samples at the model's rate), `FINISH` (one byte: a whole last frame), `CLOSE` (nothing). `ENCODE` and
  `FINISH` are answered, in order, the others not; `FINISH` frees the stream.
- The answer: `OK` and the frames, each `<II` (samples, payload length) and its payload; or `FAILED` and a message.
"""
from __future__ import annotations

import json
import os
import select
import signal
import struct
import sys
from typing import BinaryIO

import numpy as np

from realtime.audio.encoders import StreamEncoder
from realtime.audio.formats import AudioFormat

HEADER = struct.Struct("<QBI")
FRAME = struct.Struct("<II")
OPEN, ENCODE, FINISH, CLOSE, OPEN_CONTINUING = 1, 2, 3, 4, 5
OK, FAILED = 0, 1
READ_BYTES = 1 << 20
# a half-read call's rest, if the gateway's write of it is under way (a copy of ~1 MB takes ~0.1 ms); a rest that
# waits for the gateway's next loop turn (its pipe or socket pair was full) is not waited for
PIECE_WAIT_S = 0.0002


def pack_frames(frames: list) -> bytes:
    """Frames (anything with `samples` and `payload`) as an `OK` answer's payload."""
    return b"".join(FRAME.pack(frame.samples, len(frame.payload)) + frame.payload for frame in frames)


class Worker:
    def __init__(self) -> None:
        self.encoders: dict[int, StreamEncoder] = {}
        self.continuing: set[int] = set()  # open streams that go on from audio already sent (`OPEN_CONTINUING`)

    def handle(self, stream: int, op: int, payload: bytes) -> tuple[int, bytes] | None:
        """One call; its answer (status, payload), or None for a call that has none."""
        try:
            if op in (OPEN, OPEN_CONTINUING):
                self.encoders[stream] = StreamEncoder(AudioFormat(**json.loads(payload)))
                if op == OPEN_CONTINUING:
                    self.continuing.add(stream)
                return None
            if op == CLOSE:
                self._forget(stream)
                return None
            encoder = self.encoders[stream]
            if op == ENCODE:
                return OK, pack_frames(encoder.encode(np.frombuffer(payload, np.float32)))
            if op == FINISH:
                self._forget(stream)
                return OK, pack_frames(encoder.finish(whole_frame=payload == b"\x01"))
            raise ValueError(f"unknown op {op}")
        except Exception as failure:  # the stream's own fault (a bad format, a call after its end): it alone fails
            self._forget(stream)
            return None if op in (OPEN, OPEN_CONTINUING, CLOSE) else (
                FAILED, f"{type(failure).__name__}: {failure}".encode())

    def started(self, stream: int) -> bool:
        """Whether the stream's audio has begun (given out here, or before it, `OPEN_CONTINUING`)."""
        encoder = self.encoders.get(stream)
        return encoder is not None and (encoder.samples_out > 0 or stream in self.continuing)

    def _forget(self, stream: int) -> None:
        self.encoders.pop(stream, None)
        self.continuing.discard(stream)


def take_messages(buffer: bytearray) -> list[tuple[int, int, bytes]]:
    """The whole messages (stream, op or status, payload) at the start of `buffer`, taken out of it; a message still
    half there stays (the pipe protocol above, either way)."""
    messages, at = [], 0
    while len(buffer) - at >= HEADER.size:
        stream, code, length = HEADER.unpack_from(buffer, at)
        if len(buffer) - at - HEADER.size < length:
            break
        messages.append((stream, code, bytes(buffer[at + HEADER.size:at + HEADER.size + length])))
        at += HEADER.size + length
    del buffer[:at]
    return messages


class Calls:
    """The calls that have arrived on the pipe, read in whatever pieces it delivers."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffer = bytearray()

    def read(self) -> list[tuple[int, int, bytes]] | None:
        """Every whole call waiting (at least one: it blocks until one is whole), in order; None at the end of the
        input (the gateway closed the pipe: time to go). A write longer than the pipe's atomic size can reach the
        reader in pieces: while a call is half-read, the rest is waited for briefly (`PIECE_WAIT_S`), so that the
        calls of one write are read together (and ordered together, `first_audio_first`)."""
        calls: list[tuple[int, int, bytes]] = []
        while True:
            calls += take_messages(self._buffer)
            if calls and (not self._buffer or not select.select([self._fd], [], [], PIECE_WAIT_S)[0]):
                return calls
            data = os.read(self._fd, READ_BYTES)
            if not data:
                return calls or None
            self._buffer += data


def first_audio_first(calls: list[tuple[int, int, bytes]], worker: Worker) -> list[tuple[int, int, bytes]]:
    """The calls of streams whose audio has not begun go ahead of the rest, each stream's in its own order:
    every engine step hands the gateway a chunk for each of its streams at once, and a new context's first audio
    (its time to first audio) waited behind the chunks of those that were already speaking."""
    continuing = {stream for stream, op, _ in calls if op == OPEN_CONTINUING}  # opened in this very batch
    return sorted(calls, key=lambda call: worker.started(call[0]) or call[0] in continuing)


def serve(inbox: int, outbox: BinaryIO) -> None:
    worker, calls = Worker(), Calls(inbox)
    while (batch := calls.read()) is not None:
        for stream, op, payload in first_audio_first(batch, worker):
            answer = worker.handle(stream, op, payload)
            if answer is not None:
                status, data = answer
                outbox.write(HEADER.pack(stream, status, len(data)) + data)
                outbox.flush()


def main() -> None:
    """The answers go out on a private copy of stdout; stdout itself goes to stderr, so that nothing a library
    prints can break the protocol. Ctrl-C or a service manager signals the whole process group: the gateway drains
    its sessions first, encoding their last audio, and then closes the pipe, which ends this process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    outbox = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    serve(sys.stdin.fileno(), outbox)


if __name__ == "__main__":
    main()
