"""The engine on its own thread, for asyncio callers (the gateway): submit from any coroutine, read each request's
events from its own queue, cancel at any time.

The step loop owns the GPU. Text and cancels are queued as commands that the engine thread applies between
steps, so the event loop never waits for a step (tens of appends per second per session would otherwise each
wait up to a step); only a submit takes the engine's lock, to validate the request at once. A step that raises (a CUDA error) fails every request
with a `Finished(reason="error")` and marks the engine unhealthy, so readiness can turn off; it never takes the
caller's event loop down.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from engine.engine import Engine, Event, Finished, SynthesisRequest
from engine.errors import RequestError


class RequestStream:
    """One request's events, in order, ending with its `Finished`. After `cancel()` nothing more is delivered."""

    def __init__(self, request_id: int, runner: "AsyncEngine") -> None:
        self.request_id = request_id
        self._runner = runner
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = False

    def _deliver(self, event: Event) -> None:
        if not self.cancelled:
            self._events.put_nowait(event)

    def cancel(self) -> bool:
        """Stop the request now; returns whether it was still running or waiting."""
        self.cancelled = True
        return self._runner._cancel(self.request_id)

    async def __aiter__(self) -> AsyncIterator[Event]:
        while not self.cancelled:
            event = await self._events.get()
            if self.cancelled:
                return
            yield event
            if isinstance(event, Finished):
                return


class EventRouter:
    """Hands a request's events, from whichever thread has them, to its `RequestStream` on the event loop; a failure
    ends every open request with `Finished(reason="error")`."""

    def __init__(self) -> None:
        self.error: str | None = None
        self._streams: dict[int, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def active(self) -> int:
        """Requests running or waiting (open streams)."""
        return len(self._streams)

    def _publish(self, events: list[Event]) -> None:
        if not events:
            return
        streams = {event.request_id: self._streams.get(event.request_id) for event in events}
        for event in events:
            if isinstance(event, Finished):
                self._streams.pop(event.request_id, None)
        self._loop.call_soon_threadsafe(self._dispatch, events, streams)

    @staticmethod
    def _dispatch(events: list[Event], streams: dict[int, RequestStream | None]) -> None:
        for event in events:
            stream = streams[event.request_id]
            if stream is not None:
                stream._deliver(event)

    def _fail(self, message: str) -> None:
        if self.error is None:
            self.error = message
        failed = list(self._streams.values())
        self._streams.clear()
        events = [Finished(s.request_id, "error", 0, message) for s in failed]
        self._loop.call_soon_threadsafe(self._dispatch, events, {s.request_id: s for s in failed})


class AsyncEngine(EventRouter):
    def __init__(self, engine: Engine, on_step: Callable[[float, int], None] | None = None) -> None:
        """`on_step(seconds, batch)` is called after every step (metrics)."""
        super().__init__()
        self.engine = engine
        self.on_step = on_step
        self.last_step_started: float | None = None  # set while a step runs: a stalled step shows here
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._commands: deque[Callable[[], None]] = deque()  # applied by the engine thread between steps
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="voxgate-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._work.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self.engine.waiting)

    def submit(self, request: SynthesisRequest) -> RequestStream:
        """Queue a request; raises `RequestError` / `EngineFull` at once, or `RuntimeError` after a failure."""
        if self.error is not None:
            raise RuntimeError(f"the engine has failed: {self.error}")
        with self._lock:
            request_id = self.engine.submit(request)
            stream = RequestStream(request_id, self)
            self._streams[request_id] = stream
        self._work.set()
        return stream

    def append_text(self, request_id: int, text: str) -> None:
        """More text for a streaming-text request (ignored once the request has finished or was cancelled)."""
        self._command(lambda: self.engine.append_text(request_id, text))

    def end_text(self, request_id: int) -> None:
        self._command(lambda: self.engine.end_text(request_id))

    def _cancel(self, request_id: int) -> bool:
        """Nothing more is delivered from now on; the slot is freed before the next step."""
        running = self._streams.pop(request_id, None) is not None
        self._command(lambda: self.engine.cancel(request_id))
        return running

    def _command(self, command: Callable[[], None]) -> None:
        self._commands.append(command)
        self._work.set()

    def _apply_commands(self) -> None:
        """Called with the lock held. A command for a request that has just finished is moot."""
        while self._commands:
            try:
                self._commands.popleft()()
            except RequestError:
                pass

    def _run(self) -> None:
        while not self._stopping:
            self._work.clear()  # before looking, so that a command queued meanwhile wakes the wait below
            with self._lock:
                self._apply_commands()
                work = self.engine.has_work()
            if not work:  # idle, or every stream waits for its text
                self._work.wait(timeout=0.5)
                continue
            with self._lock:
                self._apply_commands()
                started = self.last_step_started = time.monotonic()
                batch = len(self.engine.running)
                try:
                    self._publish(self.engine.step(on_audio=self._publish))
                except Exception as error:  # a device failure: every request ends, the loop stays up
                    self._fail(f"{type(error).__name__}: {error}")
                    return
                finally:
                    self.last_step_started = None
            if self.on_step is not None:
                self.on_step(time.monotonic() - started, batch)
