"""The voxgate.v1 wire protocol (../shared/PROTOCOL.md): client message validation, session configuration, server
events and the binary audio header. Nothing here touches the socket or the engine, so every rule is testable alone.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field, replace
from typing import Any

from realtime.audio import AudioFormat, DEFAULT_RATES, UnsupportedFormat

PROTOCOL = "voxgate.v1"

ERROR_CODES = frozenset({
    "invalid_json", "unknown_type", "invalid_message", "invalid_config", "unsupported_format", "unknown_voice",
    "context_not_found", "context_closed", "context_limit", "text_too_long", "rate_limited", "overloaded",
    "synthesis_failed", "empty_text", "slow_consumer", "idle_timeout", "unauthorized", "internal"})
CHAT_ERROR_CODES = frozenset({"session_not_found", "no_llm", "llm_error"})  # WS /v1/chat's own (docs/protocol.md)

CLOSE_NORMAL, CLOSE_GOING_AWAY, CLOSE_POLICY, CLOSE_TOO_BIG = 1000, 1001, 1008, 1009
CLOSE_INTERNAL, CLOSE_OVERLOADED, CLOSE_UNAUTHORIZED, CLOSE_IDLE = 1011, 1013, 4001, 4008

MAGIC = 0xA1
FLAG_FIRST, FLAG_LAST, FLAG_DISCONTINUITY = 1, 2, 4
_HEADER = struct.Struct("<BBHI")

BUFFERING = ("auto", "none", "sentence")
TRANSPORTS = ("binary", "json")
PRESETS: dict[str, dict[str, Any]] = {
    "browser": {"audio": {"encoding": "opus", "sample_rate": 24000}},
    "twilio": {"audio": {"encoding": "mulaw", "sample_rate": 8000, "frame_ms": 20}, "transport": {"audio": "json"}},
    "pcm": {"audio": {"encoding": "pcm_s16le", "sample_rate": 24000}},
}


class ProtocolError(Exception):
    """A refused message: becomes an `error` event (and a close, when fatal)."""

    def __init__(self, code: str, message: str, *, fatal: bool = False, context_id: str | None = None) -> None:
        assert code in ERROR_CODES | CHAT_ERROR_CODES, code
        super().__init__(message)
        self.code, self.message, self.fatal, self.context_id = code, message, fatal, context_id


@dataclass(frozen=True)
class Sampling:
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None


@dataclass(frozen=True)
class SessionConfig:
    voice: str | None = None
    language: str = "auto"
    instructions: str | None = None
    audio: AudioFormat = field(default_factory=AudioFormat)
    transport: str = "binary"
    buffering: str = "auto"
    max_buffer_delay_ms: int = 150
    sampling: Sampling = field(default_factory=Sampling)
    timestamps: str = "none"  # "word": estimated word times (`timestamps` events)


def pack_header(flags: int, stream_id: int, pts: int) -> bytes:
    return _HEADER.pack(MAGIC, flags, stream_id & 0xFFFF, pts & 0xFFFFFFFF)


def unpack_header(frame: bytes) -> tuple[int, int, int, bytes]:
    """(flags, stream_id, pts, payload) of a binary audio frame."""
    magic, flags, stream_id, pts = _HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise ValueError(f"not a voxgate.v1 audio frame (magic {magic:#x})")
    return flags, stream_id, pts, frame[_HEADER.size:]


def event(type_: str, **fields: Any) -> dict[str, Any]:
    return {"type": type_, **{k: v for k, v in fields.items() if v is not None}}


def error_event(failure: ProtocolError, event_id: Any = None) -> dict[str, Any]:
    return event("error", code=failure.code, message=failure.message, context_id=failure.context_id,
                 fatal=failure.fatal, event_id=event_id)


# --- client messages ---------------------------------------------------------------------------------------------

_STR, _BOOL, _OBJ = (str,), (bool,), (dict,)
_NUMBER = (int, float)
# type -> {field: (accepted python types, required)}
MESSAGES: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "session.start": {"voice": (_STR, False), "language": (_STR, False), "instructions": (_STR, False),
                      "audio": (_OBJ, False), "transport": (_OBJ, False), "preset": (_STR, False),
                      "text": (_OBJ, False), "sampling": (_OBJ, False), "timestamps": (_STR, False)},
    "text.append": {"context_id": (_STR, True), "text": (_STR, True), "flush": (_BOOL, False),
                    "voice": (_STR, False), "instructions": (_STR, False), "language": (_STR, False)},
    "context.flush": {"context_id": (_STR, True)},
    "context.end": {"context_id": (_STR, True)},
    "context.cancel": {"context_id": (_STR, True), "played_ms": (_NUMBER, False)},
    "mark": {"context_id": (_STR, True), "name": (_STR, True)},
    "keepalive": {},
    "ping": {"id": ((str, int, float), False)},
    "session.close": {"mode": (_STR, False)},
}
MAX_CONTEXT_ID_CHARS = 128


def parse_message(text: str, schemas: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = MESSAGES
                  ) -> dict[str, Any]:
    """A client text frame as a validated message dict (`schemas`: voxgate.v1's messages unless another socket's);
    raises ProtocolError (never fatal)."""
    try:
        message = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as failure:
        raise ProtocolError("invalid_json", f"the message is not valid JSON: {failure}") from None
    if not isinstance(message, dict):
        raise ProtocolError("invalid_message", "a message must be a JSON object with a \"type\" field")
    kind = message.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("invalid_message", "the message has no \"type\" string")
    if kind not in schemas:
        raise ProtocolError("unknown_type", f"unknown message type {kind!r}; expected one of: {', '.join(schemas)}")
    context_id = message.get("context_id") if isinstance(message.get("context_id"), str) else None
    for name, (types, required) in schemas[kind].items():
        value = message.get(name)
        if value is None:
            if required:
                raise ProtocolError("invalid_message", f"{kind}: missing field {name!r}", context_id=context_id)
            continue
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types) or _not_finite(value):
            expected = " or ".join(_TYPE_NAMES[t] for t in types)
            raise ProtocolError("invalid_message", f"{kind}: field {name!r} must be {expected}", context_id=context_id)
    if context_id is not None and not 0 < len(context_id) <= MAX_CONTEXT_ID_CHARS:
        raise ProtocolError("invalid_message", f"context_id must be 1 to {MAX_CONTEXT_ID_CHARS} characters")
    if kind == "session.close" and message.get("mode", "graceful") not in ("graceful", "abort"):
        raise ProtocolError("invalid_message", "session.close: mode must be \"graceful\" or \"abort\"")
    return message


_TYPE_NAMES = {str: "a string", bool: "a boolean", dict: "an object", int: "a number", float: "a number",
               list: "an array"}


def _not_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


# --- session configuration ---------------------------------------------------------------------------------------

def configure(config: SessionConfig, fields: dict[str, Any]) -> tuple[SessionConfig, list[ProtocolError]]:
    """`config` updated field by field from session.start fields or query parameters (the preset first, explicit
    fields over it); a bad field is refused with its error (`invalid_config` / `unsupported_format`) and keeps its
    previous value, the others apply."""
    errors = []
    preset = fields.get("preset")
    if preset is not None:
        if preset in PRESETS:
            config = _apply(config, PRESETS[preset])
        else:
            errors.append(ProtocolError("invalid_config",
                                        f"unknown preset {preset!r}; expected one of: {', '.join(PRESETS)}"))
    for name, value in fields.items():
        if name != "preset" and name in SESSION_FIELDS:
            try:
                config = _apply(config, {name: value})
            except ProtocolError as failure:
                errors.append(failure)
    return config, errors


SESSION_FIELDS = ("voice", "language", "instructions", "audio", "transport", "text", "sampling", "timestamps")
TIMESTAMPS = ("none", "word")


def _apply(config: SessionConfig, fields: dict[str, Any]) -> SessionConfig:
    for name in ("voice", "language", "instructions"):
        if fields.get(name) is not None:
            value = fields[name]
            if not isinstance(value, str) or (name != "instructions" and not value.strip()):
                raise ProtocolError("invalid_config", f"{name} must be a non-empty string")
            config = replace(config, **{name: value})
    if fields.get("audio") is not None:
        config = replace(config, audio=_audio(config.audio, _object(fields["audio"], "audio")))
    if fields.get("transport") is not None:
        transport = _object(fields["transport"], "transport").get("audio", config.transport)
        if transport not in TRANSPORTS:
            raise ProtocolError("invalid_config", f"transport.audio must be one of: {', '.join(TRANSPORTS)}")
        config = replace(config, transport=transport)
    if fields.get("text") is not None:
        config = _text(config, _object(fields["text"], "text"))
    if fields.get("sampling") is not None:
        config = replace(config, sampling=_sampling(config.sampling, _object(fields["sampling"], "sampling")))
    if fields.get("timestamps") is not None:
        if fields["timestamps"] not in TIMESTAMPS:
            raise ProtocolError("invalid_config", f"timestamps must be one of: {', '.join(TIMESTAMPS)}")
        config = replace(config, timestamps=fields["timestamps"])
    return config


def _object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError("invalid_config", f"{name} must be an object")
    return value


def _audio(current: AudioFormat, fields: dict[str, Any]) -> AudioFormat:
    encoding = fields.get("encoding", current.encoding)
    rate = fields.get("sample_rate")
    if rate is None:  # a new encoding without a rate takes that encoding's default rate
        rate = current.sample_rate if encoding == current.encoding else DEFAULT_RATES.get(encoding, 0)
    values = dict(encoding=encoding, sample_rate=rate, frame_ms=fields.get("frame_ms", current.frame_ms),
                  bitrate=fields.get("bitrate", current.bitrate))
    for name, value in values.items():
        wanted = str if name == "encoding" else int
        if isinstance(value, bool) or not isinstance(value, wanted):
            if wanted is int and isinstance(value, float) and value.is_integer():
                values[name] = int(value)
                continue
            raise ProtocolError("invalid_config", f"audio.{name} must be {_TYPE_NAMES[wanted]}")
    try:
        return AudioFormat(**values).check()
    except UnsupportedFormat as failure:
        raise ProtocolError("unsupported_format", str(failure)) from None


def _text(config: SessionConfig, fields: dict[str, Any]) -> SessionConfig:
    buffering = fields.get("buffering", config.buffering)
    if buffering not in BUFFERING:
        raise ProtocolError("invalid_config", f"text.buffering must be one of: {', '.join(BUFFERING)}")
    delay = fields.get("max_buffer_delay_ms", config.max_buffer_delay_ms)
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay <= 10000:
        raise ProtocolError("invalid_config", "text.max_buffer_delay_ms must be a number from 0 to 10000")
    return replace(config, buffering=buffering, max_buffer_delay_ms=int(delay))


_SAMPLING_RANGES = {"temperature": (float, 0.0, 5.0), "top_k": (int, 0, 10000), "top_p": (float, 0.0, 1.0),
                    "repetition_penalty": (float, 0.5, 5.0), "seed": (int, -(2**63), 2**63 - 1)}


def _sampling(current: Sampling, fields: dict[str, Any]) -> Sampling:
    values = {}
    for name, (kind, low, high) in _SAMPLING_RANGES.items():
        value = fields.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or _not_finite(value) or not (
                low <= value <= high) or (kind is int and not float(value).is_integer()):
            what = "an integer" if kind is int else "a number"
            raise ProtocolError("invalid_config", f"sampling.{name} must be {what} from {low} to {high}")
        values[name] = kind(value)
    if "top_p" in values and values["top_p"] == 0.0:
        raise ProtocolError("invalid_config", "sampling.top_p must be greater than 0")
    return replace(current, **values)


QUERY_FIELDS = ("voice", "language", "encoding", "sample_rate", "preset")


def query_fields(params: dict[str, str]) -> tuple[dict[str, Any], list[ProtocolError]]:
    """Session defaults from the socket's query string, in session.start's shape, and the errors of bad ones."""
    fields: dict[str, Any] = {k: params[k] for k in ("voice", "language", "preset") if k in params}
    audio: dict[str, Any] = {}
    errors = []
    if "encoding" in params:
        audio["encoding"] = params["encoding"]
    if "sample_rate" in params:
        try:
            audio["sample_rate"] = int(params["sample_rate"])
        except ValueError:
            errors.append(ProtocolError("invalid_config", f"sample_rate must be an integer, not "
                                                          f"{params['sample_rate'][:20]!r}"))
    if audio:
        fields["audio"] = audio
    return fields, errors


def audio_description(fmt: AudioFormat, pre_skip: int) -> dict[str, Any]:
    described = {"encoding": fmt.encoding, "sample_rate": fmt.sample_rate, "frame_ms": fmt.frame_ms, "channels": 1}
    if fmt.encoding == "opus":
        described.update(bitrate=fmt.bitrate, pre_skip=pre_skip)
    return described
