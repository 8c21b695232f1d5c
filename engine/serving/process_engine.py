"""The engine in a process of its own, behind the same API as `AsyncEngine`.

Why: PyTorch releases the GIL around every op, so a step hands the GIL over hundreds of times, and each time
another thread of the process holds it (a server's event loop, its audio encoders), getting it back can take the
whole 5 ms switch interval. On the GPU that doubled the gateway's step at 10 sessions, and one busy Python thread
made it 124 times slower (docs/benchmarks.md, "Same batch, twice the step"). In a child process nothing competes.

The child (spawned) loads the model and runs the step loop (`step_loop.py`); the parent sends it commands through a
pipe (submit with the whole request, text, end of text, cancel) and makes the calls that the child's loop reports
(audio, finishes, step times, a failure) on this front end. The parent's end of the pipe is read and written on the
event loop itself, not by threads (`MessageReader`, `MessageWriter`). Request ids are the parent's. Submits are
validated and counted here, with the parent's own `TTSModel`, so they raise at once as `AsyncEngine`'s do. Audio
samples travel through shared memory beside the pipe (`audio_ring.py`).
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import signal
import struct
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch

from engine.core.engine import Engine, EngineConfig
from engine.errors import EngineFailed, SynthesisFailed
from engine.request import Event, Finished
from engine.serving.async_engine import FrontEnd
from engine.serving.audio_ring import AudioRing
from engine.serving.heap import freeze_long_lived
from engine.serving.step_loop import Command, StepLoop
from engine.tts import TTSModel

log = logging.getLogger("voxgate")
STOP = "stop"  # the parent's last message to the child
FORWARDED = ("publish", "step_started", "step_done", "failed")  # the child's outbox calls, made on the front end


@dataclass(frozen=True)
class EngineSpec:
    """What the child needs to build the engine: the model as `TTSModel.load` takes it, the engine config, and an
    optional `setup(engine)` the child runs on the engine it built (a picklable top-level function: instrumentation,
    fault injection in tests)."""
    model_dir: Path
    device: str
    dtype: torch.dtype
    config: EngineConfig
    setup: Callable[[Engine], None] | None = None


class ProcessEngine(FrontEnd):
    def __init__(self, spec: EngineSpec, tts: TTSModel, on_step: Callable[[float, int], None] | None = None,
                 on_failure: Callable[[EngineFailed], None] | None = None) -> None:
        """`tts`: the parent's model, which validates submits (the child loads its own from `spec`)."""
        super().__init__(tts, spec.config.max_batch, spec.config.max_waiting, on_step, on_failure)
        self.spec = spec
        self._conn: Connection | None = None
        self._process: multiprocessing.Process | None = None
        self._ring: AudioRing | None = None
        self._writer: MessageWriter | None = None
        self._reader: MessageReader | None = None
        self._ready: asyncio.Event | None = None

    def start(self) -> None:
        """Spawn the child; `ready()` waits until its engine is built. Its pipe is read and written on this event
        loop, never blocking it (see `MessageReader`)."""
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        try:
            self._ring = AudioRing.create()
        except OSError as error:  # no room in /dev/shm: the audio goes through the pipe, slower but whole
            log.warning("no shared memory for the engine's audio (%s); it goes through the pipe", error)
        self._process = context.Process(target=_child_main, name="voxgate-engine", daemon=True,
                                        args=(child_conn, self.spec, self._ring.name if self._ring else None))
        self._process.start()
        child_conn.close()
        os.set_blocking(self._conn.fileno(), False)  # this end only: the child's end of the socket pair blocks
        self._writer = MessageWriter(self._conn, self._loop)
        self._reader = MessageReader(self._conn)
        self._loop.add_reader(self._conn.fileno(), self._on_readable)

    async def ready(self) -> None:
        """Raises EngineFailed if the child could not build its engine."""
        await self._ready.wait()
        if self.error is not None:
            raise EngineFailed(f"the engine process failed: {self.error}")

    async def stop(self) -> None:
        """Ask the child to stop, kill it if it does not within 10 s; open requests end with an error."""
        if self._process is None:
            return
        error = self._stopping()
        if self._writer is not None:  # None: the child could not be started
            self._writer.send(STOP)
        await asyncio.to_thread(self._process.join, 10)
        if self._process.is_alive():
            self._process.kill()
            await asyncio.to_thread(self._process.join, 5)
        self._end_open(error)
        self._stop_reading()
        if self._writer is not None:
            self._writer.close()
        self._conn.close()
        if self._ring is not None:  # read on this loop alone, and no longer read: its memory can go
            self._ring.unlink()
            self._ring.close()
            self._ring = None

    def abort(self, error: EngineFailed) -> None:
        """Fail the engine now and kill the child (a stalled step)."""
        self.failed(error)
        self._process.kill()

    def _send(self, command: Command) -> None:
        """On the event loop, as every call of the front end."""
        try:
            self._writer.send(command)
        except Exception as failure:  # a request that cannot be pickled ends alone
            if command.kind != "submit":
                raise
            error = SynthesisFailed(f"the request could not be sent to the engine process: {failure}")
            self._loop.call_soon(self._deliver, [Finished(command.request_id, "error", 0, error)])

    # --- the child's messages, read on the event loop ------------------------------------------------------------

    def _on_readable(self) -> None:
        try:
            for kind, *args in self._reader.feed():
                if kind == "publish":
                    events, place = args
                    self._deliver(events if place is None else self._ring.incoming(events, place))
                elif kind in FORWARDED:
                    getattr(self, kind)(*args)
                elif kind == "ready":
                    self.slots = args[0]
                    self._ready.set()
                elif kind == "stopped":
                    self._stop_reading()
                    return
        except (EOFError, OSError):
            self._stop_reading()
            self.failed(EngineFailed("the engine process exited"))
        except Exception as failure:  # a bug here must not leave requests waiting forever
            self._stop_reading()
            self.failed(EngineFailed(f"the engine reader failed: {type(failure).__name__}: {failure}"))
            self._process.kill()

    def _stop_reading(self) -> None:
        """No more messages will be read (the child stopped or is gone): a `ready()` still waiting hears it now."""
        if self._reader is not None:
            self._loop.remove_reader(self._conn.fileno())
            self._reader = None
        self._ready.set()


def _frame(message: object) -> bytes:
    """A message in `Connection.send`'s wire format: a 4-byte big-endian length (-1: an 8-byte one follows), then
    its pickle; the child reads it with `Connection.recv`."""
    body = ForkingPickler.dumps(message)  # as `Connection.send` pickles: tensors by torch's sharing reductions
    head = struct.pack("!i", len(body)) if len(body) <= 0x7FFFFFFF else struct.pack("!iQ", -1, len(body))
    return head + body


class MessageWriter:
    """Messages to the child, written on the event loop without ever blocking it: each is framed at once and the
    frames waiting are written together once the loop's current callbacks have run (many text appends, one system
    call); what the pipe cannot take yet waits here until it is writable. A thread that wrote them had to get the
    GIL back from the busy loop after every write, up to the 5 ms switch interval each time."""

    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop) -> None:
        self.fd, self.loop = conn.fileno(), loop
        self.pending = bytearray()
        self.waiting_for_room = False
        self.closed = False

    def send(self, message: object) -> None:
        """Queue a message (raises what pickling it raises; nothing is queued then)."""
        if self.closed:
            return
        frame = _frame(message)
        if not self.pending:
            self.loop.call_soon(self._flush)
        self.pending += frame

    def close(self) -> None:
        """Drop what is left: the child is gone."""
        if self.waiting_for_room:
            self.loop.remove_writer(self.fd)
        self.pending.clear()
        self.closed, self.waiting_for_room = True, False

    def _flush(self) -> None:
        if self.closed or not self.pending:
            return
        try:
            written = os.write(self.fd, self.pending)
        except BlockingIOError:
            written = 0
        except OSError:  # the child is gone: the reader reports it
            self.close()
            return
        del self.pending[:written]
        if self.pending and not self.waiting_for_room:
            self.loop.add_writer(self.fd, self._flush)
        elif not self.pending and self.waiting_for_room:
            self.loop.remove_writer(self.fd)
        self.waiting_for_room = bool(self.pending)


class MessageReader:
    """A `Connection`'s messages, read in bulk from its non-blocking end on the event loop: one call takes every
    message already waiting. A reader thread needed the GIL back from the busy loop after each read and each
    hand-over to the loop, up to the 5 ms switch interval every time; in a burst of 256 sessions that put the first
    audio 246 ms p95 behind its publication (docs/benchmarks.md, "The engine process's pipe on the event loop"). The
    wire format is `Connection.send`'s (`_frame`)."""

    def __init__(self, conn: Connection, chunk_bytes: int = 1 << 20) -> None:
        self.fd, self.chunk_bytes = conn.fileno(), chunk_bytes
        self.buffer = bytearray()

    def feed(self, budget_bytes: int = 8 << 20) -> list:
        """The messages that the bytes waiting now complete, in order (none yet: []); raises EOFError once the
        other end has closed. Reads until nothing waits or `budget_bytes` are read: samples that did not fit the ring
        come in the messages (MBs a step), and one read a turn of a busy loop would fall behind them."""
        read = 0
        while read < budget_bytes:
            try:
                data = os.read(self.fd, self.chunk_bytes)
            except BlockingIOError:
                break
            if not data:
                if read:
                    break  # what came before the end first; the end on the next call
                raise EOFError
            self.buffer += data
            read += len(data)
        return self._complete()

    def _complete(self) -> list:
        buffer, at, messages = self.buffer, 0, []
        while len(buffer) - at >= 4:
            (size,), head = struct.unpack_from("!i", buffer, at), 4
            if size == -1:
                if len(buffer) - at < 12:
                    break
                (size,), head = struct.unpack_from("!Q", buffer, at + 4), 12
            if len(buffer) - at - head < size:
                break
            messages.append(pickle.loads(buffer[at + head:at + head + size]))
            at += head + size
        del buffer[:at]
        return messages


# --- the child ---------------------------------------------------------------------------------------------------

def _child_main(conn: Connection, spec: EngineSpec, ring_name: str | None) -> None:
    # Ctrl-C or a service manager signals the whole process group: the parent drains its sessions first and then
    # stops the child itself (a "stop" message, the pipe closing, or a kill).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        ring = AudioRing.attach(ring_name) if ring_name is not None else None
        engine = Engine(TTSModel.load(spec.model_dir, device=spec.device, dtype=spec.dtype), spec.config)
        if spec.setup is not None:
            spec.setup(engine)
    except Exception as failure:  # reported to the parent, whose readiness turns it into a 503
        conn.send(("failed", EngineFailed(f"{type(failure).__name__}: {failure}")))
        return
    freeze_long_lived()  # this process lives as long as its engine
    if engine.tts.device.type == "cuda":
        # Its CPU work is small tensors between launches: a pool of intra-op threads only spins (13 threads at ~17%
        # each beside 128 sessions on the H100 host), on the cores the gateway's encoder processes need.
        torch.set_num_threads(1)
    conn.send(("ready", engine.slots))
    try:
        StepLoop(engine, _PipeInbox(conn), _PipeOutbox(conn, ring)).run()
        conn.send(("stopped",))
    except (EOFError, OSError):  # the parent has gone
        pass


class _PipeInbox:
    """The parent's commands, read between steps."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def receive(self, wait_s: float) -> list[Command] | None:
        commands = []
        try:
            while self.conn.poll(wait_s):
                wait_s = 0.0
                message = self.conn.recv()
                if message == STOP:
                    return None
                commands.append(message)
        except (EOFError, OSError):  # the parent has gone
            return None
        return commands


class _PipeOutbox:
    """The step loop's reports, each sent to the parent, whose front end makes the call (`FORWARDED`); audio
    samples go through the ring (None: in the messages)."""

    def __init__(self, conn: Connection, ring: AudioRing | None) -> None:
        self.conn, self.ring = conn, ring

    def publish(self, events: list[Event]) -> None:
        self.conn.send(("publish", *(self.ring.outgoing(events) if self.ring is not None else (events, None))))

    def step_started(self) -> None:
        self.conn.send(("step_started",))

    def step_done(self, seconds: float, batch: int, waiting: int) -> None:
        self.conn.send(("step_done", seconds, batch, waiting))

    def failed(self, error: EngineFailed) -> None:
        self.conn.send(("failed", error))
