"""The engine for asyncio callers (the gateway): submit from any coroutine, read each request's events from its own
queue, cancel at any time.

`FrontEnd` is what both front ends share on the event loop; `AsyncEngine` runs the step loop (`step_loop.py`) on a
thread of this process, `process_engine.ProcessEngine` in a process of its own. The contract is the same: `submit`
validates the request (`check_request`, engine/request.py) and counts it against the engine's capacity, so it
raises at once for an invalid request, a full engine or a failed one, and never waits for a step; anything that fails
later ends that request alone with a `Finished` carrying its typed error. When the engine as a whole fails (a device
fault), every open request ends with `EngineFailed`, `error` is set and `on_failure` hears of it; it never takes
the caller's event loop down.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from engine.core.engine import Engine
from engine.core.scheduler import reserved_slots
from engine.errors import EngineFailed, EngineFull
from engine.request import Event, Finished, SynthesisRequest, check_request
from engine.serving.step_loop import Command, StepLoop
from engine.tts import TTSModel

log = logging.getLogger("voxgate")
STOP_TIMEOUT_S = 10.0  # a step that hangs this long is left behind (its thread is a daemon)


class RequestHandle:
    """One request's events, in order, ending with its `Finished`: read with `async for`, or handed to a listener as
    they come (`listen`). After `cancel()` nothing more is delivered."""

    def __init__(self, request_id: int, front_end: FrontEnd) -> None:
        self.request_id = request_id
        self._front_end = front_end
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._listener: Callable[[Event], None] | None = None
        self.cancelled = False

    def listen(self, on_event: Callable[[Event], None]) -> None:
        """From now on each event is handed to `on_event` on the event loop as it comes (those already queued first),
        instead of queued for `async for`: a caller that only files each chunk away saves it a turn of the loop, and
        in a burst of streams every turn is long. `on_event` must not raise: the handle logs what it raises and
        cancels the request, and its `Finished` never comes."""
        self._listener = on_event
        while not self.cancelled and not self._events.empty():
            self._hand(self._events.get_nowait())

    def _deliver(self, event: Event) -> None:
        if self.cancelled:
            return
        if self._listener is None:
            self._events.put_nowait(event)
        else:
            self._hand(event)

    def _hand(self, event: Event) -> None:
        try:
            self._listener(event)
        except Exception:  # one listener's bug ends its own request, never the delivery to the others
            log.exception("request %d: its listener failed", self.request_id)
            self.cancel()

    def cancel(self) -> bool:
        """Stop the request now; returns whether it was still running or waiting."""
        self.cancelled = True
        return self._front_end._cancel(self.request_id)

    async def __aiter__(self) -> AsyncIterator[Event]:
        while not self.cancelled:
            event = await self._events.get()
            if self.cancelled:
                return
            yield event
            if isinstance(event, Finished):
                return


class FrontEnd:
    """Requests in from the event loop, as commands for the step loop; the step loop's reports (its `Outbox`) back
    from its thread, each request's events to its `RequestHandle`. Subclasses carry the commands (`_send`)."""

    def __init__(self, tts: TTSModel, slots: int, max_waiting: int, on_step: Callable[[float, int], None] | None,
                 on_failure: Callable[[EngineFailed], None] | None) -> None:
        """`on_step(seconds, batch)` is called after every step (metrics), `on_failure(error)` on the event loop
        once the engine has failed (not when it is stopped)."""
        self.tts = tts
        self.slots = slots  # requests running at once (a GPU-sized engine's, known once it is built)
        self.max_waiting = max_waiting
        self.on_step = on_step
        self.on_failure = on_failure
        self.error: EngineFailed | None = None
        self._waiting_at_step = 0  # requests queued for a slot, as of the last step
        self.last_step_started: float | None = None  # set while a step runs: a stalled step shows here
        self._handles: dict[int, RequestHandle] = {}
        self._next_id = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error_lock = threading.Lock()

    @property
    def capacity(self) -> int:
        """Requests open at once: the engine's slots and its waiting room."""
        return self.slots + self.max_waiting

    @property
    def active(self) -> int:
        """Requests running or waiting (open requests)."""
        return len(self._handles)

    @property
    def waiting(self) -> int:
        """Requests queued for a slot: as the last step left them, but never more than are open now (requests
        cancelled while queued leave at once, even when no step follows to report it)."""
        return min(self._waiting_at_step, self.active)

    @property
    def contended(self) -> bool:
        """Some request waits for a slot: as the last step left them, or more are open than the engine has slots
        (no step may have run since: the running ones all wait for text)."""
        return self.waiting > 0 or self.active > self.slots

    def submit(self, request: SynthesisRequest) -> RequestHandle:
        """Queue a request; raises at once RequestError (invalid), EngineFull (as many requests open as the engine
        holds; for a one-shot request, as many as it holds less the places reserved for interactive ones) or
        EngineFailed."""
        if self.error is not None:
            raise EngineFailed(f"the engine has failed: {self.error}")
        check_request(self.tts, request)
        if self.active >= self.capacity - (0 if request.interactive else reserved_slots(self.slots)):
            raise EngineFull(f"the engine is full ({self.active} requests open); try again later")
        self._next_id += 1
        handle = RequestHandle(self._next_id, self)
        self._handles[handle.request_id] = handle
        self._send(Command("submit", handle.request_id, request))
        return handle

    def append_text(self, request_id: int, text: str) -> None:
        """More text for a streaming-text request (ignored once the request has finished or was cancelled)."""
        self._send(Command("append", request_id, text))

    def settle_text(self, request_id: int) -> None:
        """The request's text has paused: its last words are read now (`Engine.settle_text`)."""
        self._send(Command("settle", request_id))

    def end_text(self, request_id: int) -> None:
        self._send(Command("end", request_id))

    def pause(self, request_id: int, paused: bool) -> None:
        """Pause a request whose listener takes no more audio for now, or resume it (`Engine.pause`)."""
        self._send(Command("pause" if paused else "resume", request_id))

    def _cancel(self, request_id: int) -> bool:
        """Nothing more is delivered from now on; the slot is freed before the next step."""
        running = self._handles.pop(request_id, None) is not None
        self._send(Command("cancel", request_id))
        return running

    def _send(self, command: Command) -> None:
        raise NotImplementedError

    # --- the step loop's outbox: called from the engine's thread (the engine process's calls are made on the loop) ---

    def publish(self, events: list[Event]) -> None:
        self._loop.call_soon_threadsafe(self._deliver, events)

    def step_started(self) -> None:
        self.last_step_started = time.monotonic()

    def step_done(self, seconds: float, batch: int, waiting: int) -> None:
        self.last_step_started, self._waiting_at_step = None, waiting
        if self.on_step is not None:
            self.on_step(seconds, batch)

    def failed(self, error: EngineFailed) -> None:
        """The engine has failed: submits are refused from now on, and on the event loop (where submits happen, so
        none slips in between) every open request ends and `on_failure` hears of it. Only the first report counts."""
        with self._error_lock:
            if self.error is not None:
                return
            self.error = error
        self._loop.call_soon_threadsafe(self._engine_failed, error)

    # --- on the event loop ------------------------------------------------------------------------------------

    def _deliver(self, events: list[Event]) -> None:
        """Each event to its request's handle (none once it was cancelled); a finished request is no longer open."""
        for event in events:
            handle = self._handles.pop(event.request_id, None) if isinstance(event, Finished) \
                else self._handles.get(event.request_id)
            if handle is not None:
                handle._deliver(event)

    def _engine_failed(self, error: EngineFailed) -> None:
        self._end_open(error)
        if self.on_failure is not None:
            self.on_failure(error)

    def _end_open(self, error: EngineFailed) -> None:
        """Every open request ends with `error`."""
        failed = list(self._handles.values())
        self._handles.clear()
        for handle in failed:
            handle._deliver(Finished(handle.request_id, "error", 0, error))

    def _stopping(self) -> EngineFailed:
        """Submits are refused from now on, and a failure reported after this is moot; returns what open requests
        end with."""
        with self._error_lock:
            if self.error is None:
                self.error = EngineFailed("the engine has stopped")
            return self.error


class AsyncEngine(FrontEnd):
    """The step loop on a thread of this process."""

    def __init__(self, engine: Engine, on_step: Callable[[float, int], None] | None = None,
                 on_failure: Callable[[EngineFailed], None] | None = None) -> None:
        super().__init__(engine.tts, engine.slots, engine.config.max_waiting, on_step, on_failure)
        self.engine = engine
        self._inbox = _ThreadInbox()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        loop = StepLoop(self.engine, self._inbox, self)
        self._thread = threading.Thread(target=loop.run, name="voxgate-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop after the current step; open requests end with an error."""
        error = self._stopping()
        self._inbox.close()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, STOP_TIMEOUT_S)
        self._end_open(error)

    def abort(self, error: EngineFailed) -> None:
        """Fail the engine now (a stalled step): its thread cannot be interrupted, it ends once its step returns."""
        self.failed(error)
        self._inbox.close()

    def _send(self, command: Command) -> None:
        self._inbox.put(command)


class _ThreadInbox:
    """Commands from the event loop to the engine thread."""

    def __init__(self) -> None:
        self._commands: deque[Command] = deque()
        self._arrived = threading.Event()
        self._closed = False

    def put(self, command: Command) -> None:
        self._commands.append(command)
        self._arrived.set()

    def close(self) -> None:
        self._closed = True
        self._arrived.set()

    def receive(self, wait_s: float) -> list[Command] | None:
        self._arrived.wait(wait_s)
        self._arrived.clear()  # before taking: a command put meanwhile sets it again, and the next wait returns
        if self._closed:
            return None
        return [self._commands.popleft() for _ in range(len(self._commands))]
