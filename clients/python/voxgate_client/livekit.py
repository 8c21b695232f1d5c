"""A LiveKit Agents TTS over voxgate (`pip install 'voxgate-client[livekit]'`).

- `TTS.stream()` is a `SynthesizeStream` over the socket: one voxgate context per stream, LLM tokens appended as
  they come (they carry their own spaces; the server's buffering decides when they speak; tokens that come while an
  append goes out are joined into the next, at most one append per `APPEND_INTERVAL_S`, so that an LLM's burst stays
  far under the server's message rate), LiveKit's `flush` (the segment's end: LiveKit takes one segment a stream
  and drops text pushed after it) and `end_input` are `context.end`, and the server's word `timestamps` become the
  frames' timed transcript. Text with nothing but whitespace before its segment's end is nothing to say, as for
  LiveKit's base: the stream ends with no audio (the server would refuse it as `empty_text`). The sockets are
  pooled (LiveKit's `ConnectionPool`, a socket reused up to 300 s after its last use), each holding its session
  with a `keepalive` four times per idle timeout while it waits in the pool.
- Text the server will not speak (a `TEXT_REFUSALS` error naming the context, then `context.done` with no audio:
  emoji alone) fails the stream with the server's code, not retried; a silent context after another error (an
  engine restarting, overload) is LiveKit's retried failure.
- Interruption: LiveKit closes the stream (`aclose`); the context is cancelled, and the socket goes back to the pool
  once the server's `context.cancelled` ack arrived (no audio of that context follows it), or is closed.
- `TTS.synthesize()` is a `ChunkedStream` over HTTP `POST /v1/audio/speech` (`response_format: "pcm"`, 24 kHz,
  resampled by LiveKit's resampler when the TTS runs at another rate).
- Audio is PCM at the TTS's `sample_rate`, asked of the server on the socket.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import aiohttp
from livekit import rtc
from livekit.agents import APIConnectionError, APIError, APIStatusError, APITimeoutError, tts, utils
from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS, APIConnectOptions, TimedString
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, WebSocketException
from websockets.protocol import State

from voxgate_client.protocol import (
    TEXT_REFUSALS,
    ServerError,
    auth_headers,
    check_pcm_rate,
    client_message,
    handshake,
    keepalive_interval_s,
    parse_frame,
    primary_language,
)
from voxgate_client.words import spaced

logger = logging.getLogger(__name__)
HTTP_PCM_RATE = 24000  # POST /v1/audio/speech sends pcm as s16le at the model's rate
POOL_SESSION_S = 300.0  # LiveKit's pooled sockets live this long after their last use
CANCEL_ACK_TIMEOUT_S = 5.0  # a socket whose cancel is not acked by then is closed, not pooled
CLOSING_EVENTS = ("context.cancelled", "context.done")  # a cancel that crossed the context's end is acked by its done
# at most one append this often (50 a second): a burst of tokens goes as a few appends, far under the server's
# message rate (200 a second by default), at a cost of at most this much to when a token is sent
APPEND_INTERVAL_S = 0.02


@dataclass(frozen=True)
class VoiceOptions:
    voice: str | None = None  # None: the server's default voice
    language: str | None = None  # a name, an ISO code or a regional tag ("en-US" is sent as "en"); None: "auto"
    instructions: str | None = None
    seed: int | None = None  # the same seed, text and voice give the same audio


class Connection:
    """A pooled voxgate session: its socket, its `session.started`, and the keepalive that holds it while idle."""

    def __init__(self, ws: ClientConnection, session: dict[str, Any]) -> None:
        self.ws, self.session = ws, session
        self._keepalive = asyncio.create_task(self._keep_alive(keepalive_interval_s(session)))

    async def send(self, type_: str, **fields: Any) -> None:
        await self.ws.send(client_message(type_, **fields))

    async def _keep_alive(self, interval_s: float) -> None:
        with contextlib.suppress(ConnectionClosed):
            while True:
                await asyncio.sleep(interval_s)
                await self.send("keepalive")

    async def aclose(self) -> None:
        await utils.aio.cancel_and_wait(self._keepalive)
        await self.ws.close()


class TTS(tts.TTS):
    def __init__(self, *, base_url: str = "http://localhost:8000", api_key: str | None = None,
                 voice: VoiceOptions = VoiceOptions(), sample_rate: int = 24000,
                 http_session: aiohttp.ClientSession | None = None) -> None:
        """`base_url` is the server (`http://HOST:PORT`; the socket is its `/v1/tts/stream`); `http_session`:
        None takes the job's (`livekit.agents.utils.http_context`)."""
        check_pcm_rate(sample_rate)
        super().__init__(capabilities=tts.TTSCapabilities(streaming=True, aligned_transcript=True),
                         sample_rate=sample_rate, num_channels=1)
        self.base_url, self.api_key, self.voice = base_url.rstrip("/"), api_key, voice
        self._http_session = http_session
        self._pool = utils.ConnectionPool[Connection](connect_cb=self._connect, close_cb=Connection.aclose,
                                                      max_session_duration=POOL_SESSION_S, mark_refreshed_on_get=True)
        self._streams: weakref.WeakSet[SynthesizeStream] = weakref.WeakSet()

    @property
    def provider(self) -> str:
        return "voxgate"

    @property
    def socket_url(self) -> str:
        return "ws" + self.base_url.removeprefix("http") + "/v1/tts/stream"

    async def _connect(self, timeout: float) -> Connection:
        """A new session, or LiveKit's error for why there is none (its stream retries and reports only those)."""
        try:
            async with asyncio.timeout(timeout):
                ws = await ws_connect(self.socket_url, additional_headers=auth_headers(self.api_key),
                                      compression=None)
                try:
                    session = await handshake(
                        ws, audio={"encoding": "pcm_s16le", "sample_rate": self.sample_rate}, timestamps="word",
                        voice=self.voice.voice, language=primary_language(self.voice.language),
                        instructions=self.voice.instructions,
                        sampling=None if self.voice.seed is None else {"seed": self.voice.seed})
                except BaseException:
                    await ws.close()
                    raise
        except ServerError as refused:  # unauthorized, overloaded, a voice or field the server does not take
            raise APIStatusError(f"voxgate {refused.code}: {refused.message}", status_code=refused.status_code,
                                 body={"code": refused.code, "message": refused.message}) from refused
        except TimeoutError:
            raise APITimeoutError(f"voxgate: no session within {timeout} s") from None
        except (OSError, WebSocketException) as failure:  # unreachable, or no WebSocket there
            raise APIConnectionError(f"voxgate: cannot connect to {self.socket_url}") from failure
        return Connection(ws, session)

    def synthesize(self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS
                   ) -> ChunkedStream:
        return ChunkedStream(tts=self, input_text=text, conn_options=conn_options)

    def stream(self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> SynthesizeStream:
        stream = SynthesizeStream(tts=self, conn_options=conn_options)
        self._streams.add(stream)
        return stream

    def prewarm(self) -> None:
        self._pool.prewarm()

    def http_session(self) -> aiohttp.ClientSession:
        return self._http_session or utils.http_context.http_session()

    async def aclose(self) -> None:
        for stream in list(self._streams):
            await stream.aclose()
        self._streams.clear()
        await self._pool.aclose()


class ChunkedStream(tts.ChunkedStream):
    """One `POST /v1/audio/speech`, its PCM passed on as it arrives."""

    def __init__(self, *, tts: TTS, input_text: str, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, input_text=input_text, conn_options=conn_options)
        self._tts: TTS = tts

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        voice = self._tts.voice
        body = {"input": self.input_text, "response_format": "pcm", "voice": voice.voice,
                "language": primary_language(voice.language), "instructions": voice.instructions, "seed": voice.seed}
        output_emitter.initialize(request_id=utils.shortuuid(), sample_rate=self._tts.sample_rate, num_channels=1,
                                  mime_type="audio/pcm")
        if not self.input_text.strip():
            return  # LiveKit's base takes blank text as nothing to say (the server would refuse it as empty_text)
        pcm = _PCMToRate(self._tts.sample_rate)
        try:
            async with self._tts.http_session().post(
                    self._tts.base_url + "/v1/audio/speech", headers=auth_headers(self._tts.api_key),
                    json={k: v for k, v in body.items() if v is not None},
                    # each read too: a server that stalls mid-body ends in LiveKit's retry, not a hang
                    timeout=aiohttp.ClientTimeout(sock_connect=self._conn_options.timeout,
                                                  sock_read=self._conn_options.timeout)) as response:
                if response.status != 200:
                    raise await _status_error(response)
                async for chunk in response.content.iter_any():
                    _push(output_emitter, pcm.push(chunk))
            _push(output_emitter, pcm.flush())
        except TimeoutError:
            raise APITimeoutError() from None
        except aiohttp.ClientError as failure:
            raise APIConnectionError(f"voxgate: {failure}") from failure
        output_emitter.flush()


class SynthesizeStream(tts.SynthesizeStream):
    """One voxgate context on a pooled socket; `closing_event` is the server's `context.done` or
    `context.cancelled` once it came. Its messages carry the context id as `event_id`, so that an error for a
    message the server could not even read (no `context_id` in it) is still known as this stream's."""

    def __init__(self, *, tts: TTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._tts: TTS = tts
        self.closing_event: dict[str, Any] | None = None

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        context_id = utils.shortuuid()
        output_emitter.initialize(request_id=context_id, sample_rate=self._tts.sample_rate, num_channels=1,
                                  mime_type="audio/pcm", stream=True)
        text = await self._first_text()
        if text is None:
            return  # the input ended before any text: nothing to speak
        connection = await self._open_connection()
        try:
            output_emitter.start_segment(segment_id=context_id)
            voice = self._tts.voice
            await connection.send("text.append", context_id=context_id, event_id=context_id, text=text,
                                  voice=voice.voice, language=primary_language(voice.language),
                                  instructions=voice.instructions)
            self._mark_started()
            await _both(self._send_rest(connection, context_id), self._receive(connection, context_id,
                                                                               output_emitter))
        except asyncio.CancelledError:
            await self._cancel(connection, context_id)
            raise
        except (OSError, WebSocketException) as failure:  # the socket closed under a send: LiveKit retries
            self._tts._pool.remove(connection)
            raise APIConnectionError("voxgate closed the socket") from failure
        except BaseException:
            self._tts._pool.remove(connection)
            raise
        self._tts._pool.put(connection)

    async def _open_connection(self) -> Connection:
        """A pooled session whose socket is still open: a server that restarted closed the idle ones."""
        while True:
            connection = await self._tts._pool.get(timeout=self._conn_options.timeout)
            if connection.ws.state is State.OPEN:
                return connection
            self._tts._pool.remove(connection)

    async def _first_text(self) -> str | None:
        """The text up to its first visible character; None if the segment ends (a flush after text, or the end of
        the input) with none: nothing to say. A flush before any text ends nothing (LiveKit counts no segment)."""
        text = ""
        async for data in self._input_ch:
            if isinstance(data, str):
                text += data
                if text.strip():
                    return text
            elif text:
                return None
        return None

    async def _send_rest(self, connection: Connection, context_id: str) -> None:
        """The tokens verbatim, those waiting joined into one append, then a pause of `APPEND_INTERVAL_S`, up to the
        segment's end (a flush; `end_input` flushes too): `context.end`."""
        async for first in self._input_ch:
            items = [first]
            while not self._input_ch.empty():
                items.append(self._input_ch.recv_nowait())
            flush = next((i for i, item in enumerate(items) if isinstance(item, self._FlushSentinel)), None)
            await self._append(connection, context_id, "".join(items[:flush]))
            if flush is not None:
                break
            if not (self._input_ch.closed and self._input_ch.empty()):  # the end goes at once
                await asyncio.sleep(APPEND_INTERVAL_S)
        await connection.send("context.end", context_id=context_id, event_id=context_id)

    @staticmethod
    async def _append(connection: Connection, context_id: str, text: str) -> None:
        if text:
            await connection.send("text.append", context_id=context_id, event_id=context_id, text=text)

    async def _receive(self, connection: Connection, context_id: str, output_emitter: tts.AudioEmitter) -> None:
        stream_id = None
        heard, refusal = False, None  # audio came; the error that refused the context's text (TEXT_REFUSALS)
        try:
            async for data in connection.ws:
                if isinstance(data, bytes):
                    _, frame_stream, _, payload = parse_frame(data)
                    if frame_stream == stream_id and payload:
                        output_emitter.push(payload)
                        heard = True
                    continue
                event = json.loads(data)
                if context_id not in (event.get("context_id"), event.get("event_id")):
                    continue  # a session-wide event, or a late one of an earlier stream's context
                kind = event.get("type")
                if kind == "context.started":
                    stream_id = event["stream_id"]
                elif kind == "timestamps":
                    output_emitter.push_timed_transcript(
                        [TimedString(text=spaced(word), start_time=start, end_time=end)
                         for word, start, end in zip(event["words"], event["start"], event["end"])])
                elif kind == "context.done":
                    self.closing_event = event
                    if refusal is not None and not heard:  # nothing to say (emoji alone): not worth a retry
                        raise APIError(f"voxgate {refusal.get('code')}: {refusal.get('message')}", body=refusal,
                                       retryable=False)
                    output_emitter.end_segment()
                    return
                elif kind == "context.cancelled":  # by the server: its shutdown (retry elsewhere) or a fault
                    reason = event.get("reason")
                    if reason in ("shutdown", "timeout"):
                        raise APIConnectionError(f"voxgate cancelled the context ({reason})")
                    raise APIError(f"voxgate cancelled the context ({reason})", body=event, retryable=False)
                elif kind == "error" and (event.get("fatal") or stream_id is None):
                    raise APIError(f"voxgate {event.get('code')}: {event.get('message')}", body=event,
                                   retryable=False)
                elif kind in ("error", "warning"):  # the context goes on (a dropped append, a slow consumer)
                    logger.warning("voxgate %s %s: %s", kind, event.get("code"), event.get("message"))
                    refusal = event if event.get("code") in TEXT_REFUSALS else refusal
        except ConnectionClosed as closed:
            raise APIConnectionError(f"voxgate closed the socket ({closed})") from closed
        raise APIConnectionError("voxgate closed the socket before the context was done")

    async def _cancel(self, connection: Connection, context_id: str) -> None:
        """Barge-in: cancel the context and pool the socket again once the ack says no more of its audio comes."""
        try:
            async with asyncio.timeout(CANCEL_ACK_TIMEOUT_S):
                await connection.send("context.cancel", context_id=context_id)
                async for data in connection.ws:
                    event = json.loads(data) if isinstance(data, str) else {}
                    if event.get("context_id") == context_id and event.get("type") in CLOSING_EVENTS:
                        self.closing_event = event
                        self._tts._pool.put(connection)
                        return
        except (TimeoutError, ConnectionClosed):
            pass
        self._tts._pool.remove(connection)


def _push(output_emitter: tts.AudioEmitter, pcm: bytes) -> None:
    if pcm:
        output_emitter.push(pcm)


async def _both(*coroutines) -> None:
    """Run both to the end; the first to fail cancels the other."""
    tasks = [asyncio.create_task(c) for c in coroutines]
    try:
        await asyncio.gather(*tasks)
    finally:
        await utils.aio.gracefully_cancel(*tasks)


async def _status_error(response: aiohttp.ClientResponse) -> APIStatusError:
    """The server's JSON error (`{"error": {"code", "message"}}`) as LiveKit's status error."""
    body = await response.read()
    with contextlib.suppress(ValueError, KeyError, TypeError):
        error = json.loads(body)["error"]
        return APIStatusError(f"voxgate {error['code']}: {error['message']}", status_code=response.status,
                              body=error)
    return APIStatusError(f"voxgate answered {response.status}", status_code=response.status, body=body)


class _PCMToRate:
    """The speech endpoint's 24 kHz s16le bytes, in chunks of any length, as s16le bytes at `rate`."""

    def __init__(self, rate: int) -> None:
        self._resampler = rtc.AudioResampler(HTTP_PCM_RATE, rate) if rate != HTTP_PCM_RATE else None
        self._odd = b""

    def push(self, chunk: bytes) -> bytes:
        data = self._odd + chunk
        whole = len(data) - len(data) % 2
        self._odd = data[whole:]
        if self._resampler is None:
            return data[:whole]
        return _frames_pcm(self._resampler.push(bytearray(data[:whole])))

    def flush(self) -> bytes:
        return _frames_pcm(self._resampler.flush()) if self._resampler else b""


def _frames_pcm(frames: list[rtc.AudioFrame]) -> bytes:
    return b"".join(bytes(frame.data) for frame in frames)
