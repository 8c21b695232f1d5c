"""`POST /v1/audio/speech`, OpenAI-compatible: the request (its body checked here) and its audio, the whole input
spoken with one voice; `speech_response.py` encodes and sends it, streamed as it is made, as OpenAI's server-sent
events or whole. It also takes what tools written for the official Qwen3-TTS server send: the model's hub id, `stream`
and `non_streaming_mode`. OpenAI's `speed` changes the tempo as the audio streams (audio/time_stretch.py); OpenAI's
voice names map to the model's voices (voices.py), and any OpenAI TTS model name is taken."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from engine.text.cleanup import speakable
from realtime.audio.containers import format_available
from realtime.audio.formats import HTTP_FORMATS
from realtime.audio.time_stretch import SPEED_RANGE, TimeStretch
from realtime.errors import HTTPFailure, engine_http_failure
from realtime.gateway import SHUTTING_DOWN, Gateway
from realtime.lexicon import Lexicon
from realtime.lexicons_http import compile_within
from realtime.voices import VoiceError
from realtime.ws.protocol import (
    FIELD_LIMITS,
    MAX_NAME_CHARS,
    ProtocolError,
    Sampling,
    check_limit,
    lexicon_of,
    load_json,
    sampling_value,
)
from realtime.ws.speech_context import ContextAudio, ContextEnd, ReadAhead

# OpenAI's speech models, dated snapshots included: tts-1, tts-1-hd, tts-1-1106, gpt-4o-mini-tts,
# gpt-4o-mini-tts-2025-12-15; not its other models (gpt-4o, whisper-1, gpt-4o-mini-transcribe)
OPENAI_TTS_MODEL = re.compile(r"tts-1(-hd)?(-\d{4})?|gpt-[0-9a-z.]+(-mini)?-tts(-\d{4}-\d{2}-\d{2})?")
OPENAI_MODEL_EXAMPLES = "tts-1, tts-1-hd, gpt-4o-mini-tts or a dated one (gpt-4o-mini-tts-2025-12-15)"
# Qwen3-TTS's own `non_streaming_mode` -> the engine's text layout (engine/prompt.py TEXT_LAYOUTS): all the text in
# the prompt, or fed a token per frame
TEXT_LAYOUT_OF_NON_STREAMING_MODE = {True: "prefill", False: "streaming"}
DEFAULT_LAYOUT = "streaming"  # the gateway's: it starts speaking soonest
# A streamed body's synthesis waits while 5 s of its audio is made and unread (a client reading slower than real time:
# the audio would pile up in the gateway), and ends if it waits 20 s (a client that reads too little holds no slot)
READ_AHEAD = ReadAhead(pause_s=5.0, limit_s=20.0)


@dataclass(frozen=True)
class SpeechRequest:
    text: str
    voice: str | None
    instructions: str | None
    language: str
    response_format: str
    sse: bool
    seed: int | None
    stream: bool = True  # the audio goes out as it is made; False: one body, with its length, once it is all made
    layout: str = DEFAULT_LAYOUT
    speed: float = 1.0  # the tempo (2.0: twice as fast), pitch kept
    lexicon: Lexicon | None = None  # an extension: pronunciation rules (a stored lexicon's name or inline)


STRING_FIELDS = ("model", "input", "instructions", "response_format", "stream_format", "language")
# the socket's limits (voice, language, instructions), and this endpoint's own names; `input` has max_text_chars
FIELD_LIMITS_HTTP = {**FIELD_LIMITS, "model": MAX_NAME_CHARS, "response_format": MAX_NAME_CHARS,
                     "stream_format": MAX_NAME_CHARS}


async def read_speech_request(raw: bytes, gateway: Gateway) -> SpeechRequest:
    """The request in a body; an inline lexicon is compiled on the compiler thread (`compile_within` the HTTP budget),
    once every other field has passed (a refused request costs no compile)."""
    body = speech_body(raw)
    rules = body.pop("lexicon") if isinstance(body.get("lexicon"), list) else None
    request = parse_speech_request(body, gateway)
    if rules is None:
        return request
    return replace(request, lexicon=_lexicon({"lexicon": await compile_within(gateway.http_lexicon_rules, rules)},
                                             gateway))


def speech_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, parsed with the socket's rules (protocol.load_json); raises HTTPFailure(400)."""
    try:
        body = load_json(raw or b"null")
    except ProtocolError as failure:
        raise HTTPFailure.of(failure) from None
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object")
    return body


def parse_speech_request(body: dict[str, Any], gateway: Gateway) -> SpeechRequest:
    """Validate the body's fields with the socket's rules; raises HTTPFailure(400) naming the bad field."""
    _check_strings(body)
    text = body.get("input")
    if not isinstance(text, str) or not speakable(text):
        raise HTTPFailure(400, "empty_text" if isinstance(text, str) else "invalid_message",
                          "input has no letter or digit to speak" if text else
                          "input is empty: give the text to speak" if isinstance(text, str) else
                          "input is required: the text to speak", "input")
    if len(text) > gateway.limits.max_text_chars:
        raise HTTPFailure(400, "text_too_long", f"input takes at most {gateway.limits.max_text_chars} characters",
                          "input")
    _check_model(body.get("model"), gateway)
    voice = _voice(body)
    speed = _speed(body)
    # absent or null: the default; "" is a value, and not a format (it was read as absent)
    response_format = "wav" if body.get("response_format") is None else body["response_format"]
    if response_format not in HTTP_FORMATS or not format_available(response_format):
        offered = [name for name in HTTP_FORMATS if format_available(name)]
        raise HTTPFailure(400, "unsupported_format", f"response_format {response_format[:32]!r} is not available; "
                                                     f"use one of: {', '.join(offered)}", "response_format")
    stream_format = "audio" if body.get("stream_format") is None else body["stream_format"]
    if stream_format not in ("audio", "sse"):
        raise _bad("stream_format must be \"audio\" or \"sse\"", "stream_format")
    seed = body.get("seed")
    if seed is not None:
        try:
            seed = sampling_value("seed", seed, label="seed")
        except ProtocolError as failure:
            raise _bad(failure.message, "seed") from None
    sse = stream_format == "sse"
    _refuse_blank("language", body.get("language"))
    return SpeechRequest(text, voice, body.get("instructions"), body.get("language") or "auto",
                         response_format, sse, seed, _stream(body, sse), _layout(body), speed, _lexicon(body, gateway))


def _check_strings(body: dict) -> None:
    for name in STRING_FIELDS:
        if body.get(name) is not None and not isinstance(body[name], str):
            raise _bad(f"{name} must be a string", name)
        try:
            check_limit(name, body.get(name) or "", limits=FIELD_LIMITS_HTTP)
        except ProtocolError as failure:
            raise HTTPFailure.of(failure, param=name) from None


def _check_model(model: str | None, gateway: Gateway) -> None:
    """The served model by its announced name or hub id (`Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice`, what tools written
    for the official model send), or any of OpenAI's speech models (what OpenAI's clients send); another model's name
    is a mistake worth saying."""
    if model is not None and model not in gateway.model_names and not OPENAI_TTS_MODEL.fullmatch(model):
        raise _bad(f"unknown model {model[:64]!r}; this server serves {gateway.model_name!r}: use one of "
                   f"{', '.join(gateway.model_names)}, or an OpenAI speech model: {OPENAI_MODEL_EXAMPLES}", "model")


def _voice(body: dict) -> str | None:
    """`voice` as a string or in the object form OpenAI's SDK sends (`{"id": ...}`); None: the default."""
    voice = body.get("voice")
    if isinstance(voice, dict):
        voice = voice.get("id")
        if not isinstance(voice, str):
            raise _bad('voice as an object must be {"id": string}', "voice")
    elif voice is not None and not isinstance(voice, str):
        raise _bad('voice must be a string or {"id": string}', "voice")
    try:
        check_limit("voice", voice or "", limits=FIELD_LIMITS_HTTP)
    except ProtocolError as failure:
        raise HTTPFailure.of(failure, param="voice") from None
    _refuse_blank("voice", voice)
    return voice


def _refuse_blank(name: str, value: str | None) -> None:
    """A blank voice or language is a mistake, as on the socket, not a request for the default (leave it out)."""
    if value is not None and not value.strip():
        raise _bad(f"{name} must be a non-empty string; leave it out for the default", name)


def _speed(body: dict) -> float:
    """OpenAI's range; absent or null is 1.0, as other fields' null is their default."""
    low, high = SPEED_RANGE
    speed = body.get("speed")
    if speed is None:
        return 1.0
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not low <= speed <= high:
        raise _bad(f"speed must be a number from {low} to {high}", "speed")
    return float(speed)


def _stream(body: dict, sse: bool) -> bool:
    """`stream`: true (or absent, as OpenAI streams) sends the audio as it is made, false as one body."""
    stream = _optional_bool(body, "stream")
    if stream is False and sse:
        raise _bad("stream_format \"sse\" streams its events: leave stream out or set it to true", "stream")
    return stream is not False


def _layout(body: dict) -> str:
    """The engine's text layout from Qwen3-TTS's `non_streaming_mode`; absent, the gateway's."""
    non_streaming_mode = _optional_bool(body, "non_streaming_mode")
    return DEFAULT_LAYOUT if non_streaming_mode is None else TEXT_LAYOUT_OF_NON_STREAMING_MODE[non_streaming_mode]


def _optional_bool(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise _bad(f"{name} must be a boolean (true or false)", name)
    return value


def _lexicon(body: dict, gateway: Gateway) -> Lexicon | None:
    if body.get("lexicon") is None:
        return None
    try:
        return lexicon_of(body["lexicon"], gateway.lexicons, "invalid_message")
    except ProtocolError as failure:
        raise HTTPFailure.of(failure, param="lexicon") from None


def client_owner(key: str | None, address: str | None) -> str | None:
    """Whom a speech request's engine request speaks for (SynthesisRequest.owner): its API key, as a digest so that
    the key itself never leaves the gateway; on an open gateway its peer address (behind a proxy every client is
    the proxy's, and they share its turns); None if neither is known."""
    if key is not None:
        return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
    return None if address is None else f"address:{address}"


def _bad(message: str, param: str | None = None) -> HTTPFailure:
    """A 400 for the body field `param` (OpenAI's SDKs show it as the error's `param`)."""
    return HTTPFailure(400, "invalid_message", message, param)


def start_speech(request: SpeechRequest, gateway: Gateway, owner: str | None) -> AsyncIterator[np.ndarray]:
    """The request's audio chunks (float32, the model's rate) as they are made; raises HTTPFailure for a bad voice or
    language at once. `owner` (`client_owner`): a client's requests take turns with other clients' for the engine's
    slots."""
    try:
        voice = gateway.voices.resolve(gateway.voices.openai_voice(request.voice), request.instructions)
        template = gateway.template(voice, request.language, Sampling(seed=request.seed), request.layout,
                                    interactive=False,  # leaves the engine's reserved slots to conversations
                                    owner=owner)
    except VoiceError as failure:  # an unknown voice (unknown_voice), a bad language or instructions
        raise HTTPFailure(400, failure.code, str(failure), failure.field) from None
    if gateway.shutting_down:  # its body came after the drain began: it would start after the drain's last look
        raise HTTPFailure(503, "overloaded", SHUTTING_DOWN)
    speech = gateway.speech_context(template, "none", 0, request.lexicon, READ_AHEAD if request.stream else None)
    gateway.http_speech.add(speech)
    speech.append(request.text)
    speech.end()
    if speech.refusal is not None:  # the whole input is known: refused before any audio, not cut off mid-body
        speech.cancel()
        raise engine_http_failure(speech.refusal)
    return _chunks(speech) if request.speed == 1.0 else _stretched(_chunks(speech), request.speed)


async def _chunks(speech) -> AsyncIterator[np.ndarray]:
    try:
        async for item in speech.events():
            if isinstance(item, ContextAudio):
                yield item.samples
            elif isinstance(item, ContextEnd) and item.reason == "error":
                raise engine_http_failure(item.error)
    finally:
        speech.cancel()  # a client that went away frees the engine at once


async def _stretched(chunks: AsyncIterator[np.ndarray], speed: float) -> AsyncIterator[np.ndarray]:
    """`chunks` at another tempo, still streaming; closing this closes `chunks` (which frees the engine). The filter
    runs on a worker thread, as the encoders do: at 0.25x it takes ~100 ms of CPU per 2 s of audio."""
    stretch = TimeStretch(speed)
    async with contextlib.aclosing(chunks):
        async for samples in chunks:
            if len(out := await asyncio.to_thread(stretch.feed, samples)):
                yield out
    if len(rest := await asyncio.to_thread(stretch.flush)):
        yield rest
