"""`POST /v1/audio/speech`, OpenAI-compatible: the whole input spoken with one voice, returned as a file, as raw
PCM streamed while it is made, or as OpenAI's server-sent `speech.audio.delta` events. It also takes what tools
written for the official Qwen3-TTS server send: the model's hub id, `stream` and `non_streaming_mode`."""
from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from realtime.audio.files import encode_file, mp3_available
from realtime.audio.formats import HTTP_FORMATS, UnsupportedFormat, pcm_s16le
from realtime.errors import HTTPFailure, engine_http_failure
from realtime.gateway import Gateway
from realtime.lexicon import Lexicon
from realtime.voices import VoiceError
from realtime.ws.protocol import (
    FIELD_LIMITS,
    MAX_NAME_CHARS,
    MAX_SEED,
    ProtocolError,
    Sampling,
    check_limit,
    lexicon_of,
    load_json,
)
from realtime.ws.speech_context import ContextAudio, ContextEnd

OPENAI_MODEL_NAMES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
SPEED_RANGE = (0.25, 4.0)  # OpenAI's
STREAMED_FORMATS = ("pcm",)  # sent as they are made; the others are encoded whole once the audio is done
# Qwen3-TTS's own `non_streaming_mode` -> the engine's text layout (engine/prompt.py TEXT_LAYOUTS): all the text in
# the prompt, or fed a token per frame
TEXT_LAYOUT_OF_NON_STREAMING_MODE = {True: "prefill", False: "streaming"}
DEFAULT_LAYOUT = "streaming"  # the gateway's: it starts speaking soonest


@dataclass(frozen=True)
class SpeechRequest:
    text: str
    voice: str | None
    instructions: str | None
    language: str
    response_format: str
    sse: bool
    seed: int | None
    stream: bool = True  # the audio goes out as it is made; False: one body once it is all made
    layout: str = DEFAULT_LAYOUT
    lexicon: Lexicon | None = None  # an extension: pronunciation rules (a stored lexicon's name or inline)


STRING_FIELDS = ("model", "input", "voice", "instructions", "response_format", "stream_format", "language")
# the socket's limits (voice, language, instructions), and this endpoint's own names; `input` has max_text_chars
FIELD_LIMITS_HTTP = {**FIELD_LIMITS, "model": MAX_NAME_CHARS, "response_format": MAX_NAME_CHARS,
                     "stream_format": MAX_NAME_CHARS}


def parse_speech_request(raw: bytes, gateway: Gateway) -> SpeechRequest:
    """Validate the body with the socket's rules (protocol.load_json); raises HTTPFailure(400) naming the bad
    field."""
    try:
        body = load_json(raw or b"null")
    except ProtocolError as failure:
        raise HTTPFailure.of(failure) from None
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object")
    _check_strings(body)
    text = body.get("input")
    if not text or not text.strip():
        raise HTTPFailure(400, "empty_text" if isinstance(text, str) else "invalid_message",
                          "input is required: the text to speak")
    if len(text) > gateway.limits.max_text_chars:
        raise HTTPFailure(400, "text_too_long", f"input takes at most {gateway.limits.max_text_chars} characters")
    _check_model(body.get("model"), gateway)
    _check_speed(body.get("speed", 1.0))
    response_format = body.get("response_format") or "wav"
    if response_format not in HTTP_FORMATS or (response_format == "mp3" and not mp3_available()):
        offered = [f for f in HTTP_FORMATS if f != "mp3" or mp3_available()]
        raise HTTPFailure(400, "unsupported_format", f"response_format {response_format[:32]!r} is not available; "
                                                     f"use one of: {', '.join(offered)}")
    stream_format = body.get("stream_format") or "audio"
    if stream_format not in ("audio", "sse"):
        raise _bad("stream_format must be \"audio\" or \"sse\"")
    if stream_format == "sse" and response_format != "pcm":
        raise HTTPFailure(400, "unsupported_format", "stream_format \"sse\" sends PCM deltas: set "
                                                     "response_format to \"pcm\"")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise _bad(f"seed must be an integer from 0 to {MAX_SEED}")
    sse = stream_format == "sse"
    return SpeechRequest(text, body.get("voice"), body.get("instructions"), body.get("language") or "auto",
                         response_format, sse, seed, _stream(body, response_format, sse), _layout(body),
                         _lexicon(body, gateway))


def _check_strings(body: dict) -> None:
    for name in STRING_FIELDS:
        if body.get(name) is not None and not isinstance(body[name], str):
            raise _bad(f"{name} must be a string")
        try:
            check_limit(name, body.get(name) or "", limits=FIELD_LIMITS_HTTP)
        except ProtocolError as failure:
            raise HTTPFailure.of(failure) from None


def _check_model(model: str | None, gateway: Gateway) -> None:
    """The served model by its announced name or hub id (`Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice`, what tools written
    for the official model send), or one of OpenAI's names."""
    accepted = (*gateway.model_names, *OPENAI_MODEL_NAMES)
    if model is not None and model not in accepted:
        raise _bad(f"unknown model {model[:64]!r}; this server serves {gateway.model_name!r}: use one of "
                   f"{', '.join(accepted)}")


def _stream(body: dict, response_format: str, sse: bool) -> bool:
    """`stream`: true sends the audio as it is made, false as one body; absent, the formats that can stream do."""
    stream = _optional_bool(body, "stream")
    if stream is None:
        return sse or response_format in STREAMED_FORMATS
    if stream and not sse and response_format not in STREAMED_FORMATS:
        streamed = " or ".join(f'"{name}"' for name in STREAMED_FORMATS)
        raise HTTPFailure(400, "unsupported_format", f"stream: true needs a format that streams: response_format "
                                                     f"{streamed} (or stream_format \"sse\"); \"{response_format}\" "
                                                     "is sent whole: leave stream out or set it to false")
    if not stream and sse:
        raise _bad("stream_format \"sse\" streams its events: leave stream out or set it to true")
    return stream


def _layout(body: dict) -> str:
    """The engine's text layout from Qwen3-TTS's `non_streaming_mode`; absent, the gateway's."""
    non_streaming_mode = _optional_bool(body, "non_streaming_mode")
    return DEFAULT_LAYOUT if non_streaming_mode is None else TEXT_LAYOUT_OF_NON_STREAMING_MODE[non_streaming_mode]


def _optional_bool(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise _bad(f"{name} must be a boolean (true or false)")
    return value


def _lexicon(body: dict, gateway: Gateway) -> Lexicon | None:
    if body.get("lexicon") is None:
        return None
    try:
        return lexicon_of(body["lexicon"], gateway.lexicons, "invalid_message")
    except ProtocolError as failure:
        raise HTTPFailure.of(failure) from None


def _bad(message: str) -> HTTPFailure:
    return HTTPFailure(400, "invalid_message", message)


def _check_speed(speed: object) -> None:
    low, high = SPEED_RANGE
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not low <= speed <= high:
        raise _bad(f"speed must be a number from {low} to {high}")
    if speed != 1.0:
        raise _bad("speed other than 1.0 is not supported yet")


def start_speech(request: SpeechRequest, gateway: Gateway) -> AsyncIterator[np.ndarray]:
    """The request's audio chunks (float32, the model's rate) as they are made; raises HTTPFailure for a bad voice or
    language at once."""
    try:
        voice = gateway.voices.resolve(request.voice, request.instructions)
        template = gateway.template(voice, request.language, Sampling(seed=request.seed), request.layout)
    except VoiceError as failure:  # an unknown voice or language
        raise HTTPFailure(400, failure.code, str(failure)) from None
    speech = gateway.speech_context(template, "none", 0, request.lexicon)
    speech.append(request.text)
    speech.end()
    return _chunks(speech)


async def _chunks(speech) -> AsyncIterator[np.ndarray]:
    try:
        async for item in speech.events():
            if isinstance(item, ContextAudio):
                yield item.samples
            elif isinstance(item, ContextEnd) and item.reason == "error":
                raise engine_http_failure(item.error)
    finally:
        speech.cancel()  # a client that went away frees the engine at once


async def whole_file(chunks: AsyncIterator[np.ndarray], response_format: str) -> tuple[bytes, str]:
    audio = [chunk async for chunk in chunks]
    samples = np.concatenate(audio) if audio else np.zeros(0, np.float32)
    try:
        return encode_file(samples, response_format)
    except UnsupportedFormat as failure:
        raise HTTPFailure(400, "unsupported_format", str(failure)) from None


async def sse_events(chunks: AsyncIterator[np.ndarray]) -> AsyncIterator[bytes]:
    """OpenAI's speech SSE: `speech.audio.delta` with base64 PCM, then `speech.audio.done`."""
    try:
        async for samples in chunks:
            delta = {"type": "speech.audio.delta", "audio": base64.b64encode(pcm_s16le(samples)).decode("ascii")}
            yield f"data: {json.dumps(delta)}\n\n".encode()
        yield f"data: {json.dumps({'type': 'speech.audio.done'})}\n\n".encode()
    except HTTPFailure as failure:
        yield f"data: {json.dumps({'type': 'error', **failure.body()['error']})}\n\n".encode()
