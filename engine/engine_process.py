"""The engine in a process of its own, behind the same API as `AsyncEngine`.

Why: PyTorch releases the GIL around every op, so a step hands the GIL over hundreds of times, and each time
another thread of the process holds it (a server's event loop, its audio encoders), getting it back can take the
whole 5 ms switch interval. On the GPU that doubled the gateway's step at 10 sessions, and one busy Python thread
made it 124 times slower (docs/benchmarks.md, "Same batch, twice the step"). In a child process nothing competes.

The child (spawned) loads the model and runs the step loop; the parent sends commands through a pipe (submit with
the whole request, text, end of text, cancel) and a reader thread turns what comes back (audio, finishes, step
times) into each request's `RequestStream` on the event loop. Request ids are the parent's. A request the child
refuses ends with `Finished(reason="error")` instead of raising at submit.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from engine.async_engine import EventRouter, RequestStream
from engine.engine import Engine, EngineConfig, Event, Finished, SynthesisRequest
from engine.errors import RequestError

IDLE_POLL_S = 0.5


@dataclass(frozen=True)
class EngineSpec:
    """What the child needs to build the engine: the model as `TTSModel.load` takes it, and the engine config."""
    model_dir: Path
    device: str
    dtype: torch.dtype
    config: EngineConfig


class ProcessEngine(EventRouter):
    def __init__(self, spec: EngineSpec, on_step: Callable[[float, int], None] | None = None) -> None:
        """`on_step(seconds, batch)` is called after every step of the child (metrics)."""
        super().__init__()
        self.spec = spec
        self.on_step = on_step
        self.last_step_started: float | None = None  # set while the child runs a step: a stall shows here
        self.waiting = 0  # requests queued in the child for a slot, as of its last step
        self._next_id = 0
        self._outgoing: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()  # the event loop never blocks on the pipe
        self._conn: Connection | None = None
        self._process: multiprocessing.Process | None = None
        self._ready = threading.Event()

    def start(self) -> None:
        """Spawn the child; `ready()` waits until its engine is built."""
        self._loop = asyncio.get_running_loop()
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_child_main, args=(child_conn, self.spec), name="voxgate-engine",
                                        daemon=True)
        self._process.start()
        child_conn.close()
        threading.Thread(target=self._write, name="voxgate-engine-writer", daemon=True).start()
        threading.Thread(target=self._read, name="voxgate-engine-reader", daemon=True).start()

    async def ready(self) -> None:
        await asyncio.to_thread(self._ready.wait)
        if self.error is not None:
            raise RuntimeError(f"the engine process failed: {self.error}")

    async def stop(self) -> None:
        """Ask the child to stop, kill it if it does not within 10 s; open requests end with an error."""
        if self._process is None:
            return
        self._outgoing.put(("stop",))
        self._outgoing.put(None)
        await asyncio.to_thread(self._process.join, 10)
        if self._process.is_alive():
            self._process.kill()
            await asyncio.to_thread(self._process.join, 5)
        self._fail("the engine has stopped")

    def submit(self, request: SynthesisRequest) -> RequestStream:
        """Queue a request (on the event loop); a refusal arrives as its `Finished(reason="error")`."""
        if self.error is not None:
            raise RuntimeError(f"the engine has failed: {self.error}")
        self._next_id += 1
        stream = RequestStream(self._next_id, self)
        self._streams[self._next_id] = stream
        self._outgoing.put(("submit", self._next_id, request))
        return stream

    def append_text(self, request_id: int, text: str) -> None:
        self._outgoing.put(("append", request_id, text))

    def end_text(self, request_id: int) -> None:
        self._outgoing.put(("end", request_id))

    def _cancel(self, request_id: int) -> bool:
        running = self._streams.pop(request_id, None) is not None
        self._outgoing.put(("cancel", request_id))
        return running

    # --- the writer and reader threads -------------------------------------------------------------------------

    def _write(self) -> None:
        """Sends the queued commands in order; blocks (here, not on the event loop) while the child is stepping."""
        while (message := self._outgoing.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the child is gone: the reader reports it
                return
            except Exception as failure:  # a request that cannot be pickled ends alone
                if message[0] == "submit":
                    self._publish([Finished(message[1], "error", 0, f"cannot send the request: {failure}")])

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "events":
                    self._publish(message[1])
                elif kind == "step_started":
                    self.last_step_started = time.monotonic()
                elif kind == "step":
                    self.last_step_started = None
                    _, seconds, batch, self.waiting = message
                    if self.on_step is not None:
                        self.on_step(seconds, batch)
                elif kind == "ready":
                    self._ready.set()
                elif kind == "failed":
                    self._fail_soon(message[1])
                elif kind == "stopped":
                    return
        except (EOFError, OSError):
            self._fail_soon("the engine process exited")
        except Exception as failure:  # a bug here must not leave requests waiting forever
            self._fail_soon(f"the engine reader failed: {type(failure).__name__}: {failure}")
            self._process.kill()
        finally:
            self._ready.set()

    def _fail_soon(self, message: str) -> None:
        """Fail on the event loop, where submits happen, so that no submit slips in between."""
        if self.error is None:
            self.error = message
        self._loop.call_soon_threadsafe(self._fail, message)


# --- the child ---------------------------------------------------------------------------------------------------

def _child_main(conn: Connection, spec: EngineSpec) -> None:
    from engine.tts import TTSModel

    # Ctrl-C or a service manager signals the whole process group: the parent drains its sessions first and then
    # stops the child itself (a "stop" message, the pipe closing, or a kill).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = Engine(TTSModel.load(spec.model_dir, device=spec.device, dtype=spec.dtype), spec.config)
    except Exception as failure:  # reported to the parent, whose readiness turns it into a 503
        conn.send(("failed", f"{type(failure).__name__}: {failure}"))
        return
    conn.send(("ready",))
    _ChildLoop(conn, engine).run()


class _ChildLoop:
    """The step loop: commands between steps, events out as soon as a step has them."""

    def __init__(self, conn: Connection, engine: Engine) -> None:
        self.conn, self.engine = conn, engine
        self.engine_id: dict[int, int] = {}  # parent id -> engine id
        self.parent_id: dict[int, int] = {}

    def run(self) -> None:
        while self._apply_commands(wait_s=0.0 if self.engine.has_work() else IDLE_POLL_S):
            if not self.engine.has_work():
                continue
            self.conn.send(("step_started",))
            started, batch = time.monotonic(), len(self.engine.running)
            try:
                self._send_events(self.engine.step(on_audio=self._send_events))
            except Exception as failure:  # a device failure: the parent fails every request
                self.conn.send(("failed", f"{type(failure).__name__}: {failure}"))
                return
            self.conn.send(("step", time.monotonic() - started, batch, len(self.engine.waiting)))
        try:
            self.conn.send(("stopped",))
        except OSError:  # the parent has gone already
            pass

    def _apply_commands(self, wait_s: float) -> bool:
        """Apply what the parent sent; False once it asked to stop (or went away)."""
        try:
            while self.conn.poll(wait_s):
                wait_s = 0.0
                message = self.conn.recv()
                if message[0] == "stop":
                    return False
                self._apply(message)
        except (EOFError, OSError):
            return False
        return True

    def _apply(self, message: tuple) -> None:
        kind, parent_id = message[0], message[1]
        if kind == "submit":
            try:
                engine_id = self.engine.submit(message[2])
            except Exception as failure:  # a refused request (RequestError, EngineFull) ends with its reason
                self.conn.send(("events", [Finished(parent_id, "error", 0, str(failure))]))
                return
            self.engine_id[parent_id], self.parent_id[engine_id] = engine_id, parent_id
            return
        engine_id = self.engine_id.get(parent_id)
        if engine_id is None:
            return  # finished already
        if kind == "append":
            self._moot(self.engine.append_text, engine_id, message[2])
        elif kind == "end":
            self._moot(self.engine.end_text, engine_id)
        elif kind == "cancel":
            self.engine.cancel(engine_id)
            self._forget(engine_id)

    @staticmethod
    def _moot(command: Callable, *args) -> None:
        """A command for a request that finished meanwhile is moot."""
        try:
            command(*args)
        except RequestError:
            pass

    def _send_events(self, events: list[Event]) -> None:
        out = []
        for event in events:
            parent_id = self.parent_id.get(event.request_id)
            if parent_id is None:
                continue  # cancelled
            out.append(replace(event, request_id=parent_id))
            if isinstance(event, Finished):
                self._forget(event.request_id)
        if out:
            self.conn.send(("events", out))

    def _forget(self, engine_id: int) -> None:
        parent_id = self.parent_id.pop(engine_id, None)
        self.engine_id.pop(parent_id, None)
