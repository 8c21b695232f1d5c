"""An asyncio client for the voxgate.v1 socket (PROTOCOL.md), for applications, the server's tests, its load
generator and examples.

One reader task owns the socket's receiving side: it stamps each message with its arrival time (so latencies are
not skewed by whoever consumes them later) and routes it either to the `speak()` call waiting for its context or
to the shared `events()` stream, so several `speak()` calls can run concurrently on one session.

It imports nothing of the server: an application needs only `websockets` and numpy (and opuslib, the `[opus]` extra,
to decode Opus).
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import numpy as np
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from voxgate_client.protocol import (
    CONFIG_ERRORS,
    FLAG_DISCONTINUITY,
    FLAG_FIRST,
    FLAG_LAST,
    ServerError,
    auth_headers,
    client_message,
    parse_frame,
    receive_session_started,
)

_CLOSED = object()  # queued once the socket has closed


@dataclass(frozen=True, slots=True)
class AudioFrame:
    context_id: str | None
    stream_id: int | None
    flags: int
    pts: int  # in samples at the session's output rate, from the context's start
    payload: bytes
    first: bool
    last: bool


@dataclass
class ContextResult:
    """Everything one `speak()` saw of its context; times are the client's `time.monotonic()`."""
    context_id: str
    started_at: float | None = None  # the first text.append
    frames: list[AudioFrame] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # one per frame
    events: list[dict[str, Any]] = field(default_factory=list)
    done: dict[str, Any] | None = None

    @property
    def ttfa_s(self) -> float | None:
        """From the first append to the first audio frame, at the client."""
        if self.started_at is None or not self.arrivals:
            return None
        return self.arrivals[0] - self.started_at

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("type") == "error"]

    @property
    def cancelled(self) -> dict[str, Any] | None:
        return next((e for e in self.events if e.get("type") == "context.cancelled"), None)


class VoxgateClient:
    def __init__(self, ws: ClientConnection, session: dict[str, Any]) -> None:
        self.ws = ws
        self.session = session  # the latest session.started
        self.close_code: int | None = None
        self.failure: Exception | None = None  # a malformed server message ended the reader
        self._events: asyncio.Queue = asyncio.Queue()
        self._routes: dict[str, asyncio.Queue] = {}  # context id -> its speak() call's queue
        self._stream_contexts: dict[int, str] = {}
        self._context_streams: dict[str, int] = {}
        self._waiters: dict[str, asyncio.Future] = {}  # event_id -> session.start awaiting its answer
        self._event_ids = itertools.count(1)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    # --- connecting ------------------------------------------------------------------------------------------------

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, url: str, api_key: str | None = None, token: str | None = None,
                      **query: Any) -> AsyncIterator[VoxgateClient]:
        """Open a session and wait for its session.started; raises VoxgateRefused when the server refuses it."""
        client = await cls.open(url, api_key, token, **query)
        try:
            yield client
        finally:
            await client.aclose()

    @classmethod
    async def open(cls, url: str, api_key: str | None = None, token: str | None = None,
                   **query: Any) -> VoxgateClient:
        """`connect` without the context manager: the caller calls `aclose()`."""
        params = {k: v for k, v in {**query, "token": token}.items() if v is not None}
        if params:
            url += ("&" if "?" in url else "?") + urlencode(params)
        ws = await ws_connect(url, additional_headers=auth_headers(api_key), compression=None)
        try:
            first = await receive_session_started(ws)
        except BaseException:
            await ws.close()
            raise
        return cls(ws, first)

    async def aclose(self) -> None:
        await self.ws.close()
        await self._reader

    # --- sending ---------------------------------------------------------------------------------------------------

    async def send_raw(self, message: str | bytes) -> None:
        """Anything at all, for tests of the server's validation."""
        await self.ws.send(message)

    async def _send(self, type_: str, **fields: Any) -> None:
        await self.ws.send(client_message(type_, **fields))

    async def start(self, **fields: Any) -> dict[str, Any]:
        """Send session.start and return the session.started that answers it."""
        event_id = f"start-{next(self._event_ids)}"
        answer = asyncio.get_running_loop().create_future()
        self._waiters[event_id] = answer
        try:
            await self._send("session.start", event_id=event_id, **fields)
            self.session = await answer
        finally:
            self._waiters.pop(event_id, None)
        return self.session

    async def append(self, context_id: str, text: str, flush: bool = False, **first_fields: Any) -> None:
        """`first_fields` (voice, instructions, language) count only on a context's first append."""
        await self._send("text.append", context_id=context_id, text=text, flush=True if flush else None,
                         **first_fields)

    async def flush(self, context_id: str) -> None:
        await self._send("context.flush", context_id=context_id)

    async def end(self, context_id: str) -> None:
        await self._send("context.end", context_id=context_id)

    async def cancel(self, context_id: str, played_ms: float | None = None) -> None:
        await self._send("context.cancel", context_id=context_id, played_ms=played_ms)

    async def mark(self, context_id: str, name: str) -> None:
        await self._send("mark", context_id=context_id, name=name)

    async def keepalive(self) -> None:
        await self._send("keepalive")

    async def ping(self, id: str | int) -> None:
        await self._send("ping", id=id)

    async def close(self, mode: str = "graceful") -> None:
        """Ask the server to close (graceful: after the open contexts finish) and wait for the socket to close."""
        with contextlib.suppress(ConnectionClosed):
            await self._send("session.close", mode=mode)
        await asyncio.shield(self._reader)

    # --- receiving -------------------------------------------------------------------------------------------------

    async def events(self) -> AsyncIterator[AudioFrame | dict[str, Any]]:
        """Server events not taken by a `speak()` call, until the socket closes (then see `close_code`)."""
        while True:
            item = await self._events.get()
            if item is _CLOSED:
                self._events.put_nowait(_CLOSED)  # a later events() ends at once too
                if self.failure is not None:
                    raise self.failure
                return
            yield item[1]

    async def speak(self, context_id: str, pieces: Iterable[str] | AsyncIterable[str], delay_s: float = 0.0,
                    flush: bool = False) -> ContextResult:
        """Send the pieces as appends (`delay_s` apart; an async iterable paces itself), then context.end, and
        collect the context's frames and events until its context.done, its context.cancelled, or an error that
        leaves no context to finish (one on its first append, a fatal one, or the socket closing)."""
        result = ContextResult(context_id)
        queue = self._routes[context_id] = asyncio.Queue()
        try:
            await self._send_pieces(context_id, pieces, delay_s, flush, result)
            await self.end(context_id)
            await self._collect(queue, result)
        finally:
            self._routes.pop(context_id, None)
        return result

    async def _send_pieces(self, context_id: str, pieces: Iterable[str] | AsyncIterable[str], delay_s: float,
                           flush: bool, result: ContextResult) -> None:
        async for piece in _aiter(pieces):
            if result.started_at is None:
                result.started_at = time.monotonic()
            elif delay_s:
                await asyncio.sleep(delay_s)
            await self.append(context_id, piece, flush=flush)

    async def _collect(self, queue: asyncio.Queue, result: ContextResult) -> None:
        started = False
        while True:
            item = await queue.get()
            if item is _CLOSED:
                return
            arrived, message = item
            if isinstance(message, AudioFrame):
                result.frames.append(message)
                result.arrivals.append(arrived)
                continue
            result.events.append(message)
            kind = message.get("type")
            started = started or kind == "context.started"
            if kind == "context.done":
                result.done = message
                return
            if kind == "context.cancelled":
                return
            if kind == "error" and (message.get("fatal") or not started):
                return

    async def _read(self) -> None:
        try:
            async for data in self.ws:
                self._route(time.monotonic(), self._parse(data))
        except ConnectionClosed:
            pass
        except (ValueError, KeyError, TypeError) as failure:  # the server broke the protocol: consumers see why
            self.failure = failure
            await self.ws.close(1002, "protocol error")
        finally:
            self.close_code = self.ws.close_code
            for queue in (self._events, *self._routes.values()):
                queue.put_nowait(_CLOSED)
            for waiter in self._waiters.values():
                if not waiter.done():
                    waiter.set_exception(ServerError("closed", f"the socket closed ({self.close_code})"))

    def _parse(self, data: str | bytes) -> AudioFrame | dict[str, Any]:
        if isinstance(data, bytes):
            flags, stream_id, pts, payload = parse_frame(data)
            return AudioFrame(self._stream_contexts.get(stream_id), stream_id, flags, pts, payload,
                              bool(flags & FLAG_FIRST), bool(flags & FLAG_LAST))
        message = json.loads(data)
        if not isinstance(message, dict):
            raise ValueError("a server text frame is not a JSON object")
        if message.get("type") == "context.started":
            self._stream_contexts[message["stream_id"]] = message["context_id"]
            self._context_streams[message["context_id"]] = message["stream_id"]
        elif message.get("type") == "audio":
            return self._json_audio(message)
        return message

    def _json_audio(self, message: dict[str, Any]) -> AudioFrame:
        first, last = bool(message.get("first")), bool(message.get("last"))
        flags = (FLAG_FIRST if first else 0) | (FLAG_LAST if last else 0)
        pts = round(message["pts_ms"] * self.session["audio"]["sample_rate"] / 1000)
        context_id = message["context_id"]
        return AudioFrame(context_id, self._context_streams.get(context_id), flags, pts,
                          base64.b64decode(message["data"]), first, last)

    def _route(self, arrived: float, message: AudioFrame | dict[str, Any]) -> None:
        if isinstance(message, dict) and self._answers_start(message):
            return
        context_id = message.context_id if isinstance(message, AudioFrame) else message.get("context_id")
        self._routes.get(context_id, self._events).put_nowait((arrived, message))

    def _answers_start(self, message: dict[str, Any]) -> bool:
        """Resolve a waiting start(): by its session.started, or by an error after which none will come."""
        waiter = self._waiters.get(message.get("event_id"))
        if waiter is None or waiter.done():
            return False
        if message.get("type") == "session.started":
            waiter.set_result(message)
            return True
        if message.get("type") == "error" and message.get("code") not in CONFIG_ERRORS:
            waiter.set_exception(ServerError(message.get("code", ""), message.get("message", "")))
        return False


async def _aiter(pieces: Iterable[str] | AsyncIterable[str]) -> AsyncIterator[str]:
    if isinstance(pieces, AsyncIterable):
        async for piece in pieces:
            yield piece
    else:
        for piece in pieces:
            yield piece


# --- decoding ------------------------------------------------------------------------------------------------------

def context_audio(result: ContextResult, session: dict[str, Any]) -> np.ndarray:
    """A context's audio as float32 samples at the session's rate, however it was sent (`opus` decoded, `pcm_s16le`
    as is); `session` is the `session.started` it was sent under (`VoxgateClient.session`)."""
    audio = session["audio"]
    if audio["encoding"] == "opus":
        return decode_opus(result.frames, audio["sample_rate"], audio.get("pre_skip", 0))
    if audio["encoding"] == "pcm_s16le":
        return pcm_from_frames(result.frames)
    raise ValueError(f"{audio['encoding']} audio is for telephony: pass its bytes on as they are")


def decode_opus(frames: Iterable[AudioFrame], sample_rate: int, pre_skip: int = 0) -> np.ndarray:
    """Float32 samples of a context's Opus packets, the decoder's first `pre_skip` samples dropped (Ogg Opus
    semantics) at the start and again after each DISCONTINUITY frame (a fresh encoder: after a flush or mark);
    empty payloads (a LAST frame carrying no audio) are skipped, as the protocol requires."""
    import opuslib_next as opuslib

    max_samples = sample_rate * 120 // 1000  # the longest Opus packet
    pieces, decoder = [], None
    for frame in frames:
        if not frame.payload:
            continue
        if decoder is None or frame.flags & FLAG_DISCONTINUITY:
            decoder, skip = opuslib.Decoder(sample_rate, 1), pre_skip
        samples = np.frombuffer(decoder.decode(frame.payload, max_samples), dtype="<i2")
        pieces.append(samples[skip:])
        skip = max(0, skip - len(samples))
    return np.concatenate(pieces).astype(np.float32) / 32768.0 if pieces else np.zeros(0, np.float32)


def pcm_from_frames(frames: Iterable[AudioFrame]) -> np.ndarray:
    """Float32 samples of a context's pcm_s16le frames."""
    pcm = b"".join(f.payload for f in frames)
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
