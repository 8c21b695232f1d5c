"""The response of `POST /v1/audio/speech`: a request's audio encoded as it is made (`audio/containers.py`; the
containers on a worker thread, as the socket encodes, so that no response holds up the event loop) and sent as a
chunked body, as OpenAI's `speech.audio.delta` / `speech.audio.done` events, or whole with its length (made into a
file that goes to disk once large, then sent from it in blocks); and the endpoint's share of the metrics: time to
first audio from the request's arrival, audio seconds, errors by code."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

import numpy as np
from prometheus_client import Counter
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from realtime.audio.containers import ContainerBody, PcmBody, body_encoder, whole_file
from realtime.audio.formats import CONTENT_TYPES, MODEL_SAMPLE_RATE
from realtime.errors import HTTPFailure
from realtime.http_transport import GONE_EXTENSION
from realtime.metrics import TransportMetrics
from realtime.speech_http import SpeechRequest

log = logging.getLogger("voxgate")

Encoded = AsyncIterator[tuple[bytes, int]]  # (bytes ready to send, samples that went in for them)
T = TypeVar("T")
CLIENT_GONE = 499  # the status counted for a body whose client left before it was all made and sent (nginx's)
SAMPLES_PER_FRAME = MODEL_SAMPLE_RATE * 2 // 25  # one 12.5 Hz codec frame (1920): the audio token `usage` counts
WHOLE_BLOCK_BYTES = 1 << 16  # a whole body goes out from its file in blocks of this size


@dataclass
class Delivery:
    """What one response sent, for the metrics and OpenAI's `usage`."""
    metrics: TransportMetrics
    statuses: Counter  # the requests by their status (a `status` label); a streamed one's once it has ended
    arrived: float  # time.monotonic() when the request reached the handler
    first_audio_sent: bool = False
    input_tokens: int = 0  # the text's tokens (set for SSE, whose last event reports usage)
    samples: int = 0  # model-rate samples sent so far

    def sent(self, samples: int, size: int) -> None:
        """After `size` bytes went out, carrying the encoder's output for `samples` more samples."""
        if size and samples and not self.first_audio_sent:
            self.first_audio_sent = True
            self.metrics.ttfa.observe(time.monotonic() - self.arrived)
        self.samples += samples
        self.metrics.audio_seconds.inc(samples / MODEL_SAMPLE_RATE)

    def usage(self) -> dict[str, int]:
        """OpenAI's usage of a speech response: text tokens in, audio tokens out (the codec's 80 ms frames)."""
        output = -(-self.samples // SAMPLES_PER_FRAME)
        return {"input_tokens": self.input_tokens, "output_tokens": output, "total_tokens": self.input_tokens + output}

    def failed(self, failure: HTTPFailure) -> None:
        self.metrics.error(failure.code)

    def count(self, status: int) -> None:
        self.statuses.labels(status=str(status)).inc()


async def speech_response(spoken: SpeechRequest, chunks: AsyncIterator[np.ndarray], delivery: Delivery,
                          disconnected: Callable[[], Awaitable[object]]) -> Response:
    """Streamed responses start once the first audio is made, so that a request failing before any audio gets its
    error status instead of an empty 200. `disconnected` returns once the client has gone: a whole body still being
    made stops then (a streamed one stops when its send fails)."""
    headers = {"X-Sample-Rate": str(MODEL_SAMPLE_RATE)}
    if not spoken.stream:
        return await _whole_response(spoken, chunks, delivery, disconnected, headers)
    encoder = body_encoder(spoken.response_format)
    # the first audio may wait long for an engine slot: a client gone meanwhile frees its place in the queue
    made, first = await _unless_gone(_first(chunks), disconnected)
    if not made:
        await chunks.aclose()
        return Response(status_code=CLIENT_GONE)
    pieces = _encoded(_prepend(first, chunks), encoder)
    if spoken.sse:
        return CountedStream(_sse_body(pieces, delivery), delivery, media_type="text/event-stream")
    return CountedStream(_audio_body(pieces, delivery), delivery, media_type=CONTENT_TYPES[spoken.response_format],
                         headers=headers)


async def _whole_response(spoken: SpeechRequest, chunks: AsyncIterator[np.ndarray], delivery: Delivery,
                          disconnected: Callable[[], Awaitable[object]], headers: dict[str, str]) -> Response:
    """The body made whole into its file, then sent from it with its length."""
    body = whole_file()
    encoder = body_encoder(spoken.response_format, into=body)
    try:
        made, _ = await _unless_gone(_drained(_encoded(chunks, encoder)), disconnected)
    except BaseException:
        _discard(encoder, body)
        raise
    if not made:
        _discard(encoder, body)
        return Response(status_code=CLIENT_GONE)
    size = body.tell()
    delivery.sent(encoder.samples, size)
    return WholeBody(body, size, media_type=CONTENT_TYPES[spoken.response_format],
                     headers={**headers, "X-Audio-Samples": str(encoder.samples)})


def _discard(encoder: PcmBody | ContainerBody, body: BinaryIO) -> None:
    """Close an unfinished body's file once its encoder is closed (on a worker thread after a call still running
    there, as `_encoded` closes it), so that the muxer never writes to a closed file."""
    def close() -> None:
        encoder.close()
        body.close()
    if encoder.off_loop:
        asyncio.get_running_loop().run_in_executor(None, close)
    else:
        close()


class WholeBody(Response):
    """A whole body sent from its file in blocks, with its length; the file is closed (a temporary file: deleted)
    once sent or abandoned: a client gone (a connection dropped for taking too little of it, `http_transport`'s
    WRITE_STALL_S) stops the sending at the next block, not after reading the rest of the file for nobody."""

    def __init__(self, file: BinaryIO, size: int, media_type: str, headers: dict[str, str]) -> None:
        super().__init__(media_type=media_type, headers={**headers, "Content-Length": str(size)})
        self.file = file

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = scope.get("extensions", {}).get(GONE_EXTENSION, lambda: False)  # GuardedH11Protocol's
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            self.file.seek(0)
            while block := self.file.read(WHOLE_BLOCK_BYTES):
                await send({"type": "http.response.body", "body": block, "more_body": True})
                if gone():
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.file.close()


class CountedStream(StreamingResponse):
    """A streamed body whose status is counted once the response has ended: 200 when the body went out to its end,
    499 (client gone) when the client left first, 500 when making it raised. (Counted as it started, a stream its
    client left was a 200 nobody got.) A body that ended early with an error it could still report (an
    `HTTPFailure` after the first audio) went out with its 200: its error is counted by code."""

    def __init__(self, body: AsyncIterator[bytes], delivery: Delivery, **options: Any) -> None:
        super().__init__(self._to_the_end(body), **options)
        self.delivery = delivery
        self.sent_to_the_end = False

    async def _to_the_end(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async with contextlib.aclosing(body):
            async for data in body:
                yield data
        self.sent_to_the_end = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        status = 500
        try:
            await super().__call__(scope, receive, send)
            status = 200 if self.sent_to_the_end else CLIENT_GONE  # the client left: the body was cancelled
        except (ClientDisconnect, OSError, asyncio.CancelledError):
            status = CLIENT_GONE
            raise
        finally:
            self.delivery.count(status)


async def _unless_gone(work: Awaitable[T], disconnected: Callable[[], Awaitable[object]]) -> tuple[bool, T | None]:
    """(True, `work`'s result), or (False, None) once the client has gone first: the work is cancelled then, so a
    synthesis is not made, nor waits for its slot, for nobody."""
    made = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((made, gone), return_when=asyncio.FIRST_COMPLETED)
        return (True, made.result()) if made.done() else (False, None)
    finally:
        for task in (made, gone):
            task.cancel()
        await asyncio.gather(made, gone, return_exceptions=True)


async def _first(chunks: AsyncIterator[np.ndarray]) -> np.ndarray | None:
    return await anext(chunks, None)


async def _drained(pieces: Encoded) -> None:
    """Run a whole body's encoding to its end (it writes to its file)."""
    async with contextlib.aclosing(pieces):
        async for _ in pieces:
            pass


# Every generator of the chain closes the one it reads (`aclosing`): a client that leaves while a worker thread
# encodes cancels the outermost, and the innermost (`speech_http._chunks`) then frees the engine at once instead of
# whenever the garbage collector finds it.
async def _prepend(first: np.ndarray | None, chunks: AsyncIterator[np.ndarray]) -> AsyncIterator[np.ndarray]:
    async with contextlib.aclosing(chunks):
        if first is not None:
            yield first
        async for samples in chunks:
            yield samples


async def _encoded(chunks: AsyncIterator[np.ndarray], encoder: PcmBody | ContainerBody) -> Encoded:
    try:
        async with contextlib.aclosing(chunks):
            async for samples in chunks:
                yield await _run(encoder, encoder.encode, samples), len(samples)
        yield await _run(encoder, encoder.finish), 0
    finally:  # also when the client left: on a worker thread, after a call of the encoder still running there
        if encoder.off_loop:
            asyncio.get_running_loop().run_in_executor(None, encoder.close)
        else:
            encoder.close()


async def _run(encoder: PcmBody | ContainerBody, call: Callable[..., bytes], *args: object) -> bytes:
    return await asyncio.to_thread(call, *args) if encoder.off_loop else call(*args)


async def _audio_body(pieces: Encoded, delivery: Delivery) -> AsyncIterator[bytes]:
    """An audio body has no way to say that it failed after its status went out: it ends early (the log and the
    error metric say why)."""
    try:
        async with contextlib.aclosing(pieces):
            async for data, samples in pieces:
                if data:
                    yield data
                delivery.sent(samples, len(data))
    except HTTPFailure as failure:
        delivery.failed(failure)
        log.warning("a streamed speech response ended early: %s", failure.code)


async def _sse_body(pieces: Encoded, delivery: Delivery) -> AsyncIterator[bytes]:
    """OpenAI's speech events: `speech.audio.delta` with the format's bytes in base64, then `speech.audio.done` with
    the `usage` OpenAI's schema requires of it; a failure after the first event is an `error` event."""
    try:
        async with contextlib.aclosing(pieces):
            async for data, samples in pieces:
                if data:
                    yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
                delivery.sent(samples, len(data))
        yield _event({"type": "speech.audio.done", "usage": delivery.usage()})
    except HTTPFailure as failure:
        delivery.failed(failure)
        yield _event({"type": "error", "code": failure.code, "message": failure.message})


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()
