"""`POST /v1/audio/speech`, OpenAI-compatible: the whole input spoken with one voice, returned as a file, as raw
PCM streamed while it is made, or as OpenAI's server-sent `speech.audio.delta` events."""
from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.errors import RequestError
from engine.speech_context import ContextAudio, ContextEnd
from realtime.audio import HTTP_FORMATS, UnsupportedFormat, encode_file, mp3_available, to_int16
from realtime.gateway import Gateway
from realtime.protocol import Sampling
from realtime.voices import VoiceError

OPENAI_MODEL_NAMES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")


class HTTPError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message}}


@dataclass(frozen=True)
class SpeechRequest:
    text: str
    voice: str | None
    instructions: str | None
    language: str
    response_format: str
    sse: bool
    seed: int | None


def parse_speech_request(raw: bytes, gateway: Gateway) -> SpeechRequest:
    """Validate the body; raises HTTPError(400) naming the bad field."""
    try:
        body = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as failure:
        raise HTTPError(400, "invalid_json", f"the body is not valid JSON: {failure}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "invalid_message", "the body must be a JSON object")
    fields = {"model": str, "input": str, "voice": str, "instructions": str, "response_format": str,
              "stream_format": str, "language": str}
    for name, kind in fields.items():
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise HTTPError(400, "invalid_message", f"{name} must be a string")
    text = body.get("input")
    if not text or not text.strip():
        raise HTTPError(400, "empty_text" if isinstance(text, str) else "invalid_message",
                        "input is required: the text to speak")
    if len(text) > gateway.limits.max_text_chars:
        raise HTTPError(400, "text_too_long", f"input takes at most {gateway.limits.max_text_chars} characters")
    model = body.get("model")
    if model is not None and model not in (gateway.model_name, *OPENAI_MODEL_NAMES):
        raise HTTPError(400, "invalid_message", f"unknown model {model!r}; this server serves "
                                                f"{gateway.model_name!r}")
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)):
        raise HTTPError(400, "invalid_message", "speed must be a number")
    if speed != 1.0:
        raise HTTPError(400, "unsupported", "speed other than 1.0 is not supported")
    response_format = body.get("response_format") or "wav"
    if response_format not in HTTP_FORMATS or (response_format == "mp3" and not mp3_available()):
        offered = [f for f in HTTP_FORMATS if f != "mp3" or mp3_available()]
        raise HTTPError(400, "unsupported_format",
                        f"response_format {response_format!r} is not available; use one of: {', '.join(offered)}")
    stream_format = body.get("stream_format") or "audio"
    if stream_format not in ("audio", "sse"):
        raise HTTPError(400, "invalid_message", "stream_format must be \"audio\" or \"sse\"")
    if stream_format == "sse" and response_format != "pcm":
        raise HTTPError(400, "unsupported_format", "stream_format \"sse\" sends PCM deltas: set "
                                                   "response_format to \"pcm\"")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise HTTPError(400, "invalid_message", "seed must be an integer")
    return SpeechRequest(text, body.get("voice"), body.get("instructions"), body.get("language") or "auto",
                         response_format, stream_format == "sse", seed)


def start_speech(request: SpeechRequest, gateway: Gateway) -> AsyncIterator[np.ndarray]:
    """The request's audio chunks (float32, 24 kHz) as they are made; raises HTTPError for a bad voice at once."""
    try:
        voice = gateway.voices.resolve(request.voice, request.instructions)
        template = gateway.template(voice, request.language, Sampling(seed=request.seed))
    except VoiceError as failure:
        raise HTTPError(400, failure.code, str(failure)) from None
    except RequestError as failure:
        raise HTTPError(400, "invalid_config", str(failure)) from None
    speech = gateway.speech_context(template, "none", 0)
    speech.append(request.text)
    speech.end()
    return _chunks(speech)


async def _chunks(speech) -> AsyncIterator[np.ndarray]:
    try:
        async for item in speech.events():
            if isinstance(item, ContextAudio):
                yield item.samples
            elif isinstance(item, ContextEnd) and item.reason == "error":
                code = "empty_text" if item.error == "text is empty" else "synthesis_failed"
                raise HTTPError(400 if code == "empty_text" else 503 if "full" in (item.error or "") else 500,
                                "overloaded" if "full" in (item.error or "") else code, item.error or code)
    finally:
        speech.cancel()  # a client that went away frees the engine at once


async def whole_file(chunks: AsyncIterator[np.ndarray], response_format: str) -> tuple[bytes, str]:
    audio = [chunk async for chunk in chunks]
    samples = np.concatenate(audio) if audio else np.zeros(0, np.float32)
    try:
        return encode_file(samples, response_format)
    except UnsupportedFormat as failure:
        raise HTTPError(400, "unsupported_format", str(failure)) from None


def pcm_bytes(samples: np.ndarray) -> bytes:
    return to_int16(samples).astype("<i2").tobytes()


async def sse_events(chunks: AsyncIterator[np.ndarray]) -> AsyncIterator[bytes]:
    """OpenAI's speech SSE: `speech.audio.delta` with base64 PCM, then `speech.audio.done`."""
    try:
        async for samples in chunks:
            delta = {"type": "speech.audio.delta", "audio": base64.b64encode(pcm_bytes(samples)).decode("ascii")}
            yield f"data: {json.dumps(delta)}\n\n".encode()
        yield f"data: {json.dumps({'type': 'speech.audio.done'})}\n\n".encode()
    except HTTPError as failure:
        yield f"data: {json.dumps({'type': 'error', **failure.body()['error']})}\n\n".encode()
