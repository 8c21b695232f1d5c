"""The gateway's audio encoding, in processes of its own: a pool of `encoder_worker` processes, each holding the
stateful encoders of the streams given to it. The event loop only writes samples to a pipe and reads frames back, so
encoding scales across cores and never takes the loop's GIL (threads did not scale: docs/benchmarks.md, "Opus in
worker processes").

A stream stays on one worker (its encoder has state) and its calls are answered in order. A worker that dies fails
the calls of its streams with `EncoderFailed` and is replaced for the streams opened after it.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from itertools import count
from pathlib import Path

import numpy as np

from engine.errors import VoxgateError
from realtime.audio.encoder_worker import CLOSE, ENCODE, FINISH, FRAME, HEADER, OK, OPEN, OPEN_CONTINUING, take_messages
from realtime.audio.formats import AudioFormat, EncodedFrame

log = logging.getLogger("voxgate")
STOP_WAIT_S = 2.0
PIPE_BYTES = 1 << 20  # Linux's /proc/sys/fs/pipe-max-size by default


class EncoderFailed(VoxgateError):
    """An encoder call failed: its worker died, or the call was refused (the message says which)."""


def default_workers() -> int:
    """Half the machine's cores, 1 to 8: an encoder process takes ~11 ms of a core per second of Opus audio on the
    H100 host (4 of them were saturated by ~290 audio s per wall s), and the engine and the event loop need a core
    or two of the rest."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def _widen(pipe: asyncio.BaseTransport) -> None:
    """The pipe to a worker holds `PIPE_BYTES` where Linux allows it (64 KiB by default): a loop turn's calls to a
    worker in a burst (a chunk for each of its ~32 streams, ~250 KB of float32) then reach it in one piece and are
    ordered together, instead of a pipe's worth at a time, the rest a loop turn later. (Under uvloop the worker's
    input is a socket pair, not a pipe: the call fails and is skipped.)"""
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    handle = pipe.get_extra_info("pipe") or pipe.get_extra_info("socket")  # asyncio's file; uvloop's pseudo-socket
    if set_size is not None and handle is not None:
        with contextlib.suppress(OSError):
            fcntl.fcntl(handle.fileno(), set_size, PIPE_BYTES)


class _Process(asyncio.SubprocessProtocol):
    """One worker process: its pipes, and its streams' answers still due. Answers are read as the pipe delivers
    them, on the event loop's callback itself: a task between the pipe and the answers cost each chunk of audio one
    more turn of the loop, and in a burst of sessions every turn is long (docs/benchmarks.md, "Where the rest of the
    burst goes")."""

    def __init__(self) -> None:
        self.transport: asyncio.SubprocessTransport | None = None
        self.due: dict[int, deque[asyncio.Future[bytes]]] = {}  # stream -> its calls not yet answered, in order
        self.streams = 0  # open streams
        self.dead: EncoderFailed | None = None
        self.on_death: Callable[[_Process], None] | None = None  # told once if it ends unasked (the pool replaces it)
        self._received = bytearray()
        self._unsent: list[bytes] = []  # calls of this loop turn, not yet written
        self._room = asyncio.Event()  # the pipe to the worker takes more (cleared while its buffer is over its mark)
        self._room.set()
        self._exited = asyncio.get_running_loop().create_future()

    @property
    def pid(self) -> int:
        return self.transport.get_pid()

    def send(self, stream: int, op: int, payload: bytes = b"") -> None:
        """Written with the loop turn's other calls to this worker, in order, at the turn's end (`_flush`): each
        engine step gives every stream a chunk at once, and a system call each was a large part of the loop's work
        per chunk; the worker then sees the turn's calls together and puts new streams' first audio ahead."""
        if self.dead is not None:
            raise self.dead
        if not self._unsent:
            asyncio.get_running_loop().call_soon(self._flush)
        self._unsent.append(HEADER.pack(stream, op, len(payload)) + payload)

    def _flush(self) -> None:
        unsent, self._unsent = self._unsent, []
        pipe = self.transport.get_pipe_transport(0)
        if unsent and not pipe.is_closing():  # a pipe that is gone: the worker's end fails the calls due (`_die`)
            pipe.write(b"".join(unsent))

    async def call(self, stream: int, op: int, payload: bytes) -> bytes:
        """Send a call that is answered; its answer's payload."""
        answer = asyncio.get_running_loop().create_future()
        self.send(stream, op, payload)
        self.due.setdefault(stream, deque()).append(answer)
        await self._room.wait()
        return await answer

    # --- the transport's callbacks ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self._received += data
        for stream, status, payload in take_messages(self._received):
            self._answer(stream, status, payload)

    def _answer(self, stream: int, status: int, payload: bytes) -> None:
        queue = self.due.get(stream)
        if not queue:
            return  # a stream closed while a call was in flight
        answer = queue.popleft()
        if not queue:
            del self.due[stream]
        if answer.done():
            return  # its caller was cancelled
        if status == OK:
            answer.set_result(payload)
        else:
            answer.set_exception(EncoderFailed(payload.decode(errors="replace")))

    def pause_writing(self) -> None:
        self._room.clear()

    def resume_writing(self) -> None:
        self._room.set()

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if fd == 1:  # every answer it wrote has been read: those still due will not come
            self._die(EncoderFailed(f"the audio encoder process {self.pid} ended"))
        else:
            self._room.set()  # nothing waits for room in a pipe that is gone (the next send raises)

    def process_exited(self) -> None:
        """Its exit may be reported before the last answers in its pipe are read: they end the calls, not this."""
        self._exited.set_result(None)

    def _die(self, failure: EncoderFailed) -> None:
        ended_unasked = self.dead is None
        if ended_unasked:
            log.error("%s", failure)
        self.dead = failure
        self._room.set()
        for queue in self.due.values():
            for answer in queue:
                if not answer.done():
                    answer.set_exception(failure)
        self.due.clear()
        if ended_unasked and self.on_death is not None:
            self.on_death(self)

    async def stop(self) -> None:
        self.dead = self.dead or EncoderFailed("the audio encoders are stopping")
        with contextlib.suppress(OSError):
            self._flush()  # a stream's last calls go before the end of the input
            self.transport.get_pipe_transport(0).close()
        try:
            await asyncio.wait_for(asyncio.shield(self._exited), STOP_WAIT_S)
        except TimeoutError:
            self.transport.kill()
            await self._exited
        self.transport.close()


class EncoderPool:
    def __init__(self, workers: int | None = None) -> None:
        """`workers`: processes; None: `default_workers()`."""
        self.size = workers if workers is not None else default_workers()
        if self.size < 1:
            raise ValueError("the encoder pool needs at least one worker")
        self._workers: list[_Process] = []
        self._replacements: dict[_Process, asyncio.Task] = {}  # dead worker -> the start of the one in its place
        self._ids = count(1)

    async def start(self) -> None:
        self._workers = [await self._spawn() for _ in range(self.size)]

    async def stop(self) -> None:
        workers, self._workers = self._workers, []
        replacements = list(self._replacements.values())
        for task in replacements:
            task.cancel()
        await asyncio.gather(*(worker.stop() for worker in workers), *replacements, return_exceptions=True)

    async def _spawn(self) -> _Process:
        """A worker that the pool replaces at once if it dies: else the first stream opened after a crash found no
        live worker (a hostile try: with one worker, that context was refused)."""
        root = str(Path(__file__).resolve().parents[2])  # where `realtime` is, whoever started this process
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        # A session of its own, out of the server's process group: a Ctrl-C there must not stop the encoding of the
        # sessions the server then drains (the worker ignores SIGINT and SIGTERM too, and leaves when its pipe closes).
        _, worker = await asyncio.get_running_loop().subprocess_exec(
            _Process, sys.executable, "-m", "realtime.audio.encoder_worker", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=None, env={**os.environ, "PYTHONPATH": path},
            start_new_session=True)
        _widen(worker.transport.get_pipe_transport(0))
        worker.on_death = self._replace
        return worker

    def open(self, fmt: AudioFormat, continuing: bool = False) -> PooledEncoder:
        """A new stream's encoder, on the live worker with the fewest open streams (a dead one is being replaced).
        `continuing`: the stream goes on from audio already sent (a context's encoder after a flush), so its first
        chunk is not first audio and does not go ahead of other streams' (`first_audio_first`)."""
        if not self._workers:
            raise EncoderFailed("the audio encoders are not running")
        live = [worker for worker in self._workers if worker.dead is None]
        if not live:
            raise EncoderFailed("no audio encoder process is running; try again shortly")
        return PooledEncoder(min(live, key=lambda w: w.streams), next(self._ids), fmt.check(), continuing)

    def _replace(self, dead: _Process) -> None:
        """Start a worker in the dead one's place (told once, `_Process.on_death`); until it runs, the streams opened
        go to the others."""
        async def replace() -> None:
            try:
                fresh = await self._spawn()
            except OSError:
                log.exception("could not restart an audio encoder process")
                return
            finally:
                self._replacements.pop(dead, None)
            if dead in self._workers:
                self._workers[self._workers.index(dead)] = fresh
            else:  # the pool stopped meanwhile
                await fresh.stop()

        self._replacements[dead] = asyncio.get_running_loop().create_task(replace())


class PooledEncoder:
    """One stream's `StreamEncoder`, in a worker: the same calls, awaited."""

    def __init__(self, worker: _Process, stream: int, fmt: AudioFormat, continuing: bool = False) -> None:
        self.format = fmt
        self._worker, self._stream = worker, stream
        self._samples_out = 0
        self._open = True
        worker.send(stream, OPEN_CONTINUING if continuing else OPEN, json.dumps(asdict(fmt)).encode())
        worker.streams += 1

    @property
    def samples_out(self) -> int:
        """Total samples of the frames given out so far."""
        return self._samples_out

    async def encode(self, samples: np.ndarray) -> list[EncodedFrame]:
        """The complete frames that `samples` (float32, 24 kHz) finish; the rest waits in the worker for more."""
        if not self._open:
            raise EncoderFailed("encode after the stream's end")
        data = np.ascontiguousarray(samples, dtype=np.float32).reshape(-1).tobytes()
        return self._frames(await self._worker.call(self._stream, ENCODE, data))

    async def finish(self, whole_frame: bool = False) -> list[EncodedFrame]:
        """The stream's last frames (`StreamEncoder.finish`); the worker forgets the stream."""
        if not self._open:
            return []
        self._release()
        return self._frames(await self._worker.call(self._stream, FINISH, b"\x01" if whole_frame else b"\x00"))

    def close(self) -> None:
        """Forget the stream without its last frames (a cancelled context); nothing if it has finished."""
        if self._open:
            self._release()
            with contextlib.suppress(EncoderFailed, OSError):
                self._worker.send(self._stream, CLOSE)

    def _release(self) -> None:
        self._open = False
        self._worker.streams -= 1

    def _frames(self, payload: bytes) -> list[EncodedFrame]:
        frames, at = [], 0
        while at < len(payload):
            samples, length = FRAME.unpack_from(payload, at)
            at += FRAME.size
            frames.append(EncodedFrame(payload[at:at + length], self._samples_out, samples))
            self._samples_out += samples
            at += length
        return frames
