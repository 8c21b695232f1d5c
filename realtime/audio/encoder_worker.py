"""An encoder process of the gateway's `EncoderPool` (`python -m realtime.audio.encoder_worker`): it holds the
`StreamEncoder`s of the streams given to it and runs their calls one after another, so the gateway's event loop never
shares a GIL with libopus, soxr and their numpy glue (one process did ~130 audio s per wall s over many threads on
the H100 host: the threads waited for the GIL, not the CPU; docs/benchmarks.md).

The pipe protocol, both ways a header `<QBI` (stream, op or status, payload length) and the payload:
- `OPEN` (the `AudioFormat` as JSON), `ENCODE` (float32 samples at the model's rate), `FINISH` (one byte: a whole last
  frame), `CLOSE` (nothing). `ENCODE` and `FINISH` are answered, in order, the others not; `FINISH` frees the stream.
- The answer: `OK` and the frames, each `<II` (samples, payload length) and its payload; or `FAILED` and a message.
"""
from __future__ import annotations

import json
import os
import signal
import struct
import sys
from typing import BinaryIO

import numpy as np

from realtime.audio.encoders import StreamEncoder
from realtime.audio.formats import AudioFormat

HEADER = struct.Struct("<QBI")
FRAME = struct.Struct("<II")
OPEN, ENCODE, FINISH, CLOSE = 1, 2, 3, 4
OK, FAILED = 0, 1


def pack_frames(frames: list) -> bytes:
    """Frames (anything with `samples` and `payload`) as an `OK` answer's payload."""
    return b"".join(FRAME.pack(frame.samples, len(frame.payload)) + frame.payload for frame in frames)


class Worker:
    def __init__(self) -> None:
        self.encoders: dict[int, StreamEncoder] = {}

    def handle(self, stream: int, op: int, payload: bytes) -> tuple[int, bytes] | None:
        """One call; its answer (status, payload), or None for a call that has none."""
        try:
            if op == OPEN:
                self.encoders[stream] = StreamEncoder(AudioFormat(**json.loads(payload)))
                return None
            if op == CLOSE:
                self.encoders.pop(stream, None)
                return None
            encoder = self.encoders[stream]
            if op == ENCODE:
                return OK, pack_frames(encoder.encode(np.frombuffer(payload, np.float32)))
            if op == FINISH:
                del self.encoders[stream]
                return OK, pack_frames(encoder.finish(whole_frame=payload == b"\x01"))
            raise ValueError(f"unknown op {op}")
        except Exception as failure:  # the stream's own fault (a bad format, a call after its end): it alone fails
            self.encoders.pop(stream, None)
            return None if op in (OPEN, CLOSE) else (FAILED, f"{type(failure).__name__}: {failure}".encode())


def _read(pipe: BinaryIO, size: int) -> bytes | None:
    """Exactly `size` bytes, or None at the end of the input (the gateway closed the pipe: time to go)."""
    data = pipe.read(size)
    return data if len(data) == size else None


def serve(inbox: BinaryIO, outbox: BinaryIO) -> None:
    worker = Worker()
    while (header := _read(inbox, HEADER.size)) is not None:
        stream, op, length = HEADER.unpack(header)
        payload = _read(inbox, length) if length else b""
        if payload is None:
            return
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
    serve(sys.stdin.buffer, outbox)


if __name__ == "__main__":
    main()
