"""A Pipecat TTS service over voxgate.v1 (`pip install 'voxgate-client[pipecat]'`).

How Pipecat's notions map onto the protocol:
- a turn (Pipecat's turn context id) is one voxgate context; its sentences (or tokens) are `text.append`s;
- sentence aggregation (Pipecat's default): each sentence is appended with `flush: true`, so the server speaks it to
  its end at once; Pipecat hands sentences over without the space between them ("Sure!" then "The"), so a space is
  put back between two sentences of a turn. Token streaming: tokens carry their own spaces and go verbatim, and the
  server's own buffering decides when they speak; a turn's first token goes at once, later ones that come within
  `APPEND_INTERVAL_S` of each other go as one append, so that an LLM's burst stays far under the server's message
  rate;
- `flush_audio` (the end of a turn, or a settings change) is `context.end`;
- an interruption is `context.cancel`: the server sends no audio for the context after its ack, and audio already
  on the way is dropped here, since Pipecat forgets the context's audio at once;
- the server's word `timestamps` become Pipecat's word timestamps (TTSTextFrames in time with the audio);
- the voice, language and instructions go with each context's first append, so a settings update speaks from the
  next turn on;
- audio is PCM at the pipeline's output rate (asked of the server, no resampling); a `keepalive` goes out four
  times per idle timeout, so a quiet pipeline keeps its socket.

A turn whose text the server refuses (`TEXT_REFUSALS`: `empty_text`, `text_too_long`, `invalid_message`) is an
application error, pushed up the pipeline; with no audio, it does not count toward Pipecat's
`max_consecutive_zero_audio_contexts` (a silent provider), and the `context_not_found` its `context.end` may draw is
not reported. A turn the server failed (`synthesis_failed`, `overloaded`) counts, as any silent one.

`on_context_finished(service, context_id, event)` fires with the server's `context.done` or `context.cancelled`.
"""
from __future__ import annotations

import asyncio
import itertools
import json
from collections import deque
from collections.abc import AsyncGenerator
from typing import Any

from loguru import logger
from pipecat.frames.frames import ErrorFrame, Frame, TTSAudioRawFrame, TTSStoppedFrame
from pipecat.processors.frame_processor import FrameProcessorSetup
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TextAggregationMode, WebsocketTTSService
from pipecat.transcriptions.language import Language
from pipecat.utils.errors import ErrorCategory
from websockets.asyncio.client import ClientConnection
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
from voxgate_client.words import is_wide

STOP_FRAME_TIMEOUT_S = 10.0
# streamed tokens after a turn's first go at most this often (50 appends a second), those that came meanwhile joined:
# far under the server's message rate (200 a second by default)
APPEND_INTERVAL_S = 0.02
REFUSED_REMEMBERED = 64  # turns the server refused, remembered for their late context_not_found and their outcome


class VoxgateTTSService(WebsocketTTSService):
    """Streams a Pipecat pipeline's text to a voxgate server and its audio back, a voxgate context per turn."""

    def __init__(self, *, url: str, api_key: str | None = None, voice: str | None = None,
                 language: Language | str | None = None, instructions: str | None = None,
                 sampling: dict[str, Any] | None = None,
                 text_aggregation_mode: TextAggregationMode | None = None, **kwargs: Any) -> None:
        """`url` is the socket (`ws://HOST:PORT/v1/tts/stream`); `voice` / `language` None: the server's defaults;
        `sampling` is the session's `sampling` object (a `seed` makes the audio repeatable)."""
        # Pipecat ends an audio context that receives nothing for stop_frame_timeout_s (3 s by default), dropping
        # what comes later; voxgate ends every context itself (context.done / context.cancelled, or the socket's
        # close), so that fallback only has to outwait a busy server's first audio
        kwargs.setdefault("stop_frame_timeout_s", STOP_FRAME_TIMEOUT_S)
        super().__init__(text_aggregation_mode=text_aggregation_mode, push_text_frames=False, push_start_frame=True,
                         settings=TTSSettings(model=None, voice=voice, language=language), **kwargs)
        self._url, self._api_key = url, api_key
        self._instructions, self._sampling = instructions, sampling
        self._receive_task = None
        self._session: dict[str, Any] = {}  # the session.started answering our session.start
        self._open_contexts: dict[str, str] = {}  # context id -> the text sent so far, for joining sentences
        self._started_contexts: set[str] = set()  # contexts the server opened (context.started)
        self._stream_contexts: dict[int, str] = {}  # stream id -> context id, for binary frames
        self._unsent: dict[str, str] = {}  # context id -> streamed tokens waiting for the next append
        self._appending: asyncio.Task | None = None  # sends `_unsent` every APPEND_INTERVAL_S while there is any
        self._send_lock = asyncio.Lock()  # an end goes out after the tokens of its context, never between them
        self._refused: deque[str] = deque(maxlen=REFUSED_REMEMBERED)  # contexts the server did not open
        self._register_event_handler("on_context_finished")

    def can_generate_metrics(self) -> bool:
        return True

    def language_to_service_language(self, language: Language) -> str | None:
        """The server takes ISO codes ("en"); Pipecat's regional ones ("en-US") lose their region."""
        return primary_language(language.value)

    async def setup(self, setup: FrameProcessorSetup) -> None:
        await super().setup(setup)
        check_pcm_rate(self.sample_rate)
        await self._connect()

    # --- the socket ------------------------------------------------------------------------------------------------

    async def _connect(self) -> None:
        await super()._connect()
        await self._connect_websocket()
        if self._websocket is None:
            return
        if not self._receive_task:
            self._receive_task = self.create_task(self._receive_task_handler(self._report_error))
        self._create_keepalive_task(keepalive_interval_s(self._session))

    async def _disconnect(self) -> None:
        await super()._disconnect()
        self._unsent.clear()
        if self._appending is not None:
            await self.cancel_task(self._appending)
            self._appending = None
        if self._receive_task:
            await self.cancel_task(self._receive_task)
            self._receive_task = None
        await self._cancel_keepalive_task()
        await self._disconnect_websocket()

    async def _connect_websocket(self) -> None:
        if self._websocket and self._websocket.state is State.OPEN:
            return
        try:
            websocket = await self._websocket_connect(self._url, additional_headers=auth_headers(self._api_key),
                                                      compression=None)
            self._session = await handshake(websocket, **self._session_fields())
        except Exception as failure:  # refused, unreachable, or a field the server would not take
            self._websocket = None
            # Pipecat classifies it by the exception: a refusal's status (ServerError.status_code: unauthorized and
            # a refused voice are lasting, overloaded is not), a connection error as connectivity
            await self.push_error(error_msg=f"voxgate connection failed: {failure}", exception=failure)
            await self._call_event_handler("on_connection_error", str(failure))
            return
        self._websocket = websocket
        self._open_contexts.clear()
        self._started_contexts.clear()
        self._stream_contexts.clear()
        self._unsent.clear()
        await self._call_event_handler("on_connected")

    async def _reconnect_websocket(self, attempt_number: int) -> bool:
        """A turn that came while Pipecat's reconnect loop waited out its backoff dialed a socket of its own
        (`run_tts`): keep it, and the turn's context on it, instead of closing it to dial again."""
        if self._websocket is not None and self._websocket.state is State.OPEN:
            return True
        return await super()._reconnect_websocket(attempt_number)

    def _session_fields(self) -> dict[str, Any]:
        """What `session.start` asks for: PCM at the pipeline's rate, word timestamps, the voice (checked by the
        server here, so that a voice it does not have fails the connection, not the first turn)."""
        return {"audio": {"encoding": "pcm_s16le", "sample_rate": self.sample_rate}, "timestamps": "word",
                "sampling": self._sampling, **self._voice_fields()}

    async def _disconnect_websocket(self) -> None:
        try:
            await self.stop_all_metrics()
            if self._websocket:
                await self._websocket.close()
        finally:
            self._websocket = None
            await self._call_event_handler("on_disconnected")

    async def _send(self, type_: str, **fields: Any) -> None:
        if self._websocket is None:
            raise ConnectionError("the voxgate socket is not connected")
        await self._websocket.send(client_message(type_, **fields))

    async def _send_keepalive(self) -> None:
        await self._send("keepalive")

    # --- text in ---------------------------------------------------------------------------------------------------

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Append the text to the turn's context (opened by its first append); audio arrives on the receive task."""
        if not self._websocket or self._websocket.state is State.CLOSED:
            await self._connect()
        sent = self._open_contexts.get(context_id)
        if sent is not None and self._is_streaming_tokens:  # a later token: joined with those waiting
            self._unsent[context_id] = self._unsent.get(context_id, "") + text
            self._open_contexts[context_id] = sent + text
            if self._appending is None:
                self._appending = self.create_task(self._send_unsent())
            await self.start_tts_usage_metrics(text)
            yield None
            return
        first = self._voice_fields() if sent is None else {}
        try:
            await self._send("text.append", context_id=context_id, event_id=context_id, text=self._joined(sent, text),
                             flush=None if self._is_streaming_tokens else True, **first)
        except Exception as failure:
            yield TTSStoppedFrame(context_id=context_id)
            yield ErrorFrame(error=f"voxgate: sending text failed: {failure}")
            return
        self._open_contexts[context_id] = (sent or "") + text
        await self.start_tts_usage_metrics(text)
        yield None

    async def _send_unsent(self) -> None:
        """Every APPEND_INTERVAL_S, the tokens that came meanwhile as one append per context, until none wait."""
        try:
            while self._unsent:
                await asyncio.sleep(APPEND_INTERVAL_S)
                async with self._send_lock:
                    unsent, self._unsent = self._unsent, {}
                    for context_id, text in unsent.items():
                        await self._send("text.append", context_id=context_id, event_id=context_id, text=text)
        except Exception as failure:  # the socket went: Pipecat's reconnect takes over
            await self.push_error(error_msg=f"voxgate: sending text failed: {failure}", exception=failure)
        finally:
            self._appending = None

    def _voice_fields(self) -> dict[str, Any]:
        """A context's first append carries the voice as the settings have it now, so that a settings update
        (`TTSUpdateSettingsFrame`) speaks from the next turn on."""
        return {"voice": self._settings.voice, "language": self._settings.language,
                "instructions": self._instructions}

    def _joined(self, sent: str | None, text: str) -> str:
        return text if self._is_streaming_tokens else join_sentence(sent or "", text)

    async def flush_audio(self, context_id: str | None = None) -> None:
        """The end of the turn: no more text for its context (`context.end`)."""
        context_id = context_id or self.get_active_audio_context_id()
        if context_id in self._open_contexts and self._websocket:
            del self._open_contexts[context_id]
            async with self._send_lock:
                if text := self._unsent.pop(context_id, ""):
                    await self._send("text.append", context_id=context_id, event_id=context_id, text=text)
                await self._send("context.end", context_id=context_id)

    async def on_audio_context_interrupted(self, context_id: str) -> None:
        """Barge-in: the server stops the context; its late audio finds no audio context here and is dropped. The
        cancel goes out whatever is known of the context here: a turn already ended (`context.end` sent) may not be
        started yet, and the server acks a cancel of any id."""
        await self.stop_all_metrics()
        self._open_contexts.pop(context_id, None)
        self._unsent.pop(context_id, None)
        if self._websocket and self._websocket.state is State.OPEN:
            async with self._send_lock:  # after any append of it already on its way, never before one
                await self._send("context.cancel", context_id=context_id)
        await super().on_audio_context_interrupted(context_id)

    # --- audio and events out --------------------------------------------------------------------------------------

    async def _receive_messages(self) -> None:
        async for data in self._get_websocket():
            if isinstance(data, bytes):
                await self._on_audio(data)
            else:
                await self._on_event(json.loads(data))

    def _get_websocket(self) -> ClientConnection:
        if self._websocket:
            return self._websocket
        raise ConnectionError("the voxgate socket is not connected")

    async def _on_audio(self, data: bytes) -> None:
        _, stream_id, _, payload = parse_frame(data)
        context_id = self._stream_contexts.get(stream_id)
        if payload and context_id and self.audio_context_available(context_id):
            await self.append_to_audio_context(
                context_id, TTSAudioRawFrame(payload, self.sample_rate, 1, context_id=context_id))

    async def _on_event(self, event: dict[str, Any]) -> None:
        kind, context_id = event.get("type"), event.get("context_id")
        if kind == "context.started":
            self._started_contexts.add(context_id)
            self._stream_contexts[event["stream_id"]] = context_id
        elif kind == "timestamps":
            await self._add_words(event, context_id)
        elif kind in ("context.done", "context.cancelled"):
            await self._finish(context_id)
            await self._call_event_handler("on_context_finished", context_id, event)
        elif kind == "error":
            await self._on_error(event)
        elif kind == "warning":
            logger.warning(f"{self}: voxgate warning {event.get('code')}: {event.get('message')}")

    async def _add_words(self, event: dict[str, Any], context_id: str) -> None:
        """Pipecat joins word frames with spaces unless a frame says it carries its own: CJK words (a character and
        its punctuation, no spaces between them) say so, so that the turn's text in the LLM context stays as
        written."""
        words = list(zip(event["words"], event["start"]))
        for wide, run in itertools.groupby(words, key=lambda word: is_wide(word[0][0])):
            await self.add_word_timestamps(list(run), context_id, includes_inter_frame_spaces=True if wide else None)

    async def _on_error(self, event: dict[str, Any]) -> None:
        """Errors go up the pipeline; one that kept a turn's context from opening ends that turn's audio. Appends
        carry the context id as `event_id`: an append the server could not read is still known as the turn's. A
        fatal error (the session closes: unauthorized, idle, a slow consumer) is classified by its status; one
        turn's refused text is the application's, and leaves the service usable."""
        context_id = event.get("context_id") or event.get("event_id")
        message = f"voxgate error {event.get('code')}: {event.get('message')}"
        if event.get("code") == "context_not_found" and context_id in self._refused:
            logger.debug(f"{self}: the end of refused turn {context_id} found no context, as expected")
            return
        if event.get("fatal"):
            await self.push_error(error_msg=message, exception=ServerError(event.get("code", ""),
                                                                           event.get("message", "")))
        else:
            await self.push_error(error_msg=message, category=ErrorCategory.APPLICATION)
        if context_id and event.get("code") in TEXT_REFUSALS:
            self._refused.append(context_id)
        if context_id and context_id not in self._started_contexts:
            self._open_contexts.pop(context_id, None)
            self._unsent.pop(context_id, None)
            await self._finish(context_id)

    async def _record_context_audio_outcome(self, context_id: str, received_audio: bool) -> None:
        """Pipecat's count of turns that ended with no audio (a provider silent for a bad voice, say) leaves out the
        turns whose text the server refused (`TEXT_REFUSALS`, such as empty_text for emoji alone): that error was
        pushed already, and it is the application's; a turn failed by the server (synthesis_failed, overloaded)
        still counts (Pipecat 1.14's hook, `TTSService._record_context_audio_outcome`)."""
        if received_audio or context_id not in self._refused:
            await super()._record_context_audio_outcome(context_id, received_audio)

    async def _finish(self, context_id: str) -> None:
        self._open_contexts.pop(context_id, None)
        self._started_contexts.discard(context_id)
        self._stream_contexts = {s: c for s, c in self._stream_contexts.items() if c != context_id}
        if self.audio_context_available(context_id):
            await self.stop_ttfb_metrics()
            await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
            await self.remove_audio_context(context_id)


def join_sentence(sent: str, sentence: str) -> str:
    """The next sentence as appended after `sent`: Pipecat's sentences come without the space between them
    ("Sure!" then "The"), so one is put back, except where either side has one or the text is CJK (no spaces)."""
    if not sent or sent[-1].isspace() or sentence[:1].isspace() or is_wide(sent[-1]):
        return sentence
    return " " + sentence
