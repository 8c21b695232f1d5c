"""The engine's step loop, run by both asyncio front ends: on a thread of the caller's process (`async_engine.py`) or
in a process of its own (`process_engine.py`). Only the transport differs: how commands come in (`Inbox`) and how
what the loop reports goes out (`Outbox`).

Commands (submit, more text, end of text, cancel) are applied between steps, so a caller never waits for a step,
and each one's failure is its request's alone: a submit the engine refuses ends that request with its typed error.
Request ids are the front end's. A step runs while there is work, and its events go out as soon as it has them. An
exception out of a step (a device fault) is the engine's failure: `EngineFailed` goes out and the loop ends.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Protocol

from engine.core.engine import Engine
from engine.errors import EngineFailed, RequestError, VoxgateError
from engine.request import Event, Finished, SynthesisRequest

IDLE_POLL_S = 0.5
log = logging.getLogger("voxgate")


@dataclass(frozen=True)
class Command:
    kind: str  # "submit" | "append" | "settle" | "end" | "pause" | "resume" | "cancel"
    request_id: int  # the front end's id
    payload: SynthesisRequest | str | None = None  # the request (submit) or the text (append)


class Inbox(Protocol):
    def receive(self, wait_s: float) -> list[Command] | None:
        """The commands that have arrived, waiting up to `wait_s` for one; None once the front end stops the loop."""


class Outbox(Protocol):
    """What the loop reports, from its own thread: the front end (or, from the child, its pipe) takes it."""

    def publish(self, events: list[Event]) -> None: ...

    def step_started(self) -> None: ...

    def step_done(self, seconds: float, batch: int, waiting: int) -> None: ...

    def failed(self, error: EngineFailed) -> None: ...


class StepLoop:
    def __init__(self, engine: Engine, inbox: Inbox, outbox: Outbox) -> None:
        self.engine, self.inbox, self.outbox = engine, inbox, outbox
        self._engine_ids: dict[int, int] = {}  # front end id -> engine id, while the request is open
        self._request_ids: dict[int, int] = {}  # engine id -> front end id

    def run(self) -> None:
        """Until the front end stops the loop, or the engine fails."""
        try:
            while (commands := self.inbox.receive(
                    0.0 if self.engine.has_work() else self.engine.idle_wait_s(IDLE_POLL_S))) is not None:
                for command in commands:
                    self._apply(command)
                if self.engine.has_work():
                    self._step()
        except Exception as failure:
            self.outbox.failed(engine_failure(failure))

    def _apply(self, command: Command) -> None:
        if command.kind == "submit":
            self._submit(command.request_id, command.payload)
            return
        engine_id = self._engine_ids.get(command.request_id)
        if engine_id is None:
            return  # the request has finished: the command is moot
        try:
            match command.kind:
                case "append":
                    self.engine.append_text(engine_id, command.payload)
                case "settle":
                    self.engine.settle_text(engine_id)
                case "end":
                    self.engine.end_text(engine_id)
                case "pause" | "resume":
                    self.engine.pause(engine_id, command.kind == "pause")
                case "cancel":
                    self.engine.cancel(engine_id)
                    self._forget(engine_id)
        except RequestError:
            pass  # the request has ended in the engine meanwhile (its Finished is on its way): moot

    def _submit(self, request_id: int, request: SynthesisRequest) -> None:
        try:
            engine_id = self.engine.submit(request)
        except VoxgateError as refused:  # what the front end could not check: a prompt too long, a failed plan
            self.outbox.publish([Finished(request_id, "error", 0, refused)])
            return
        self._engine_ids[request_id], self._request_ids[engine_id] = engine_id, request_id

    def _step(self) -> None:
        self.outbox.step_started()
        started, batch = time.monotonic(), len(self.engine.running)
        self._publish(self.engine.step(on_audio=self._publish))
        self.outbox.step_done(time.monotonic() - started, batch, len(self.engine.waiting))

    def _publish(self, events: list[Event]) -> None:
        out = []
        for event in events:
            request_id = self._request_ids.get(event.request_id)
            if request_id is None:
                continue  # cancelled
            out.append(replace(event, request_id=request_id))
            if isinstance(event, Finished):
                self._forget(event.request_id)
        if out:
            self.outbox.publish(out)

    def _forget(self, engine_id: int) -> None:
        request_id = self._request_ids.pop(engine_id, None)
        self._engine_ids.pop(request_id, None)


def engine_failure(failure: Exception) -> EngineFailed:
    """What every open request hears when the engine fails; the traceback goes to the log, once."""
    if isinstance(failure, EngineFailed):
        return failure
    log.error("the engine failed", exc_info=failure)
    return EngineFailed(f"the engine failed: {type(failure).__name__}: {failure}")
