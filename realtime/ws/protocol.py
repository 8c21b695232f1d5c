"""The voxgate.v1 wire protocol (docs/PROTOCOL.md): client message validation, session configuration, server
events and the binary audio header. Nothing here touches the socket or the engine, so every rule is testable alone.
"""
from __future__ import annotations

import contextlib
import json
import math
import re
import struct
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol

from realtime.audio.formats import DEFAULT_RATES, MODEL_SAMPLE_RATE, OPUS_BITRATES, AudioFormat, UnsupportedFormat
from realtime.lexicon import Lexicon, LexiconError, LexiconsBusy
from realtime.ws.utterances import BUFFERING

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

TRANSPORTS = ("binary", "json")
# the ASGI scope extension under which the server gives a session a way to write a text message at once, past its
# send queue (`GatewayWebSocketProtocol._write_now`): its fatal error when the peer reads nothing
WRITE_NOW_EXTENSION = "voxgate.write_now"
# ... and a way to send a message without the ASGI layers' awaits when nothing would make it wait
# (`GatewayWebSocketProtocol._send_now`): the sender's path for each audio packet and event
SEND_NOW_EXTENSION = "voxgate.send_now"
PRESETS: dict[str, dict[str, Any]] = {
    "browser": {"audio": {"encoding": "opus", "sample_rate": MODEL_SAMPLE_RATE}},
    "twilio": {"audio": {"encoding": "mulaw", "sample_rate": 8000, "frame_ms": 20}, "transport": {"audio": "json"}},
    "pcm": {"audio": {"encoding": "pcm_s16le", "sample_rate": MODEL_SAMPLE_RATE}},
}


class ProtocolError(Exception):
    """A refused message: becomes an `error` event (and a close, when fatal)."""

    def __init__(self, code: str, message: str, *, fatal: bool = False, context_id: str | None = None,
                 event_id: Any = None) -> None:
        if code not in ERROR_CODES | CHAT_ERROR_CODES:
            raise ValueError(f"not a protocol error code: {code!r}")
        super().__init__(message)
        self.code, self.message, self.fatal, self.context_id = code, message, fatal, context_id
        self.event_id = event_id  # the client message's, echoed on the error
        self.field: str | None = None  # the message's top-level field at fault, where one is (HTTP's `param`)


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
    lexicon: Lexicon | None = None  # pronunciation rules for every context (a context's own replace them)


def pack_header(flags: int, stream_id: int, pts: int) -> bytes:
    return _HEADER.pack(MAGIC, flags, stream_id & 0xFFFF, pts & 0xFFFFFFFF)


def event(type_: str, **fields: Any) -> dict[str, Any]:
    return {"type": type_, **{k: v for k, v in fields.items() if v is not None}}


def error_event(failure: ProtocolError, event_id: Any = None) -> dict[str, Any]:
    return event("error", code=failure.code, message=failure.message, context_id=failure.context_id,
                 fatal=failure.fatal, event_id=event_id)


# --- client messages ---------------------------------------------------------------------------------------------

CONTEXT_FIELDS = ("voice", "instructions", "language", "lexicon")  # a text.append's, read on a context's first only

_STR, _BOOL, _OBJ = (str,), (bool,), (dict,)
_NUMBER = (int, float)
_ANY = (object,)
SESSION_FIELDS = ("voice", "language", "instructions", "audio", "transport", "text", "sampling", "timestamps")
SESSION_START_FIELDS = ("preset", *SESSION_FIELDS, "lexicon")
# type -> {field: (accepted python types, required)}; session.start's fields are checked one by one by `configure`
MESSAGES: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "session.start": {name: (_ANY, False) for name in SESSION_START_FIELDS},
    "text.append": {"context_id": (_STR, True), "text": (_STR, True), "flush": (_BOOL, False),
                    "voice": (_STR, False), "instructions": (_STR, False), "language": (_STR, False),
                    "lexicon": ((str, list), False)},
    "context.flush": {"context_id": (_STR, True)},
    "context.end": {"context_id": (_STR, True)},
    "context.cancel": {"context_id": (_STR, True), "played_ms": (_NUMBER, False)},
    "mark": {"context_id": (_STR, True), "name": (_STR, True)},
    "keepalive": {},
    "ping": {"id": ((str, int, float), False)},
    "session.close": {"mode": (_STR, False)},
}
MAX_NAME_CHARS = 128  # ids and names: context_id, voice, language, mark name, event_id, ...
MAX_INSTRUCTIONS_CHARS = 2000  # a voice description or style instruction
MAX_PLAYED_MS = 10**9
MAX_SEED = 2**63 - 1  # the engine offsets it per utterance, modulo 2**63
MAX_JSON_DEPTH = 32  # nesting of arrays and objects in one message
MAX_INTEGER_DIGITS = 20  # 2**64 has 20 digits; any longer integer is out of every range
MAX_JSON_CONTAINERS = 10_000  # arrays and objects in one message (a lexicon of 1,000 rules has 1,001)
MAX_DROPPED_PEEK_BYTES = 1024  # a rate-limited message this small is read for its ids
_LONG_DIGITS = re.compile(rf"\d{{{MAX_INTEGER_DIGITS + 1},}}")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
# field -> most characters (strings) or (lowest, highest) (numbers), in every message type that has the field
FIELD_LIMITS: dict[str, int | tuple[float, float]] = {
    "context_id": MAX_NAME_CHARS, "voice": MAX_NAME_CHARS, "language": MAX_NAME_CHARS, "name": MAX_NAME_CHARS,
    "preset": MAX_NAME_CHARS, "timestamps": MAX_NAME_CHARS, "mode": MAX_NAME_CHARS, "id": MAX_NAME_CHARS,
    "session_id": MAX_NAME_CHARS, "instructions": MAX_INSTRUCTIONS_CHARS, "played_ms": (0, MAX_PLAYED_MS)}


def load_json(raw: str | bytes, code: str = "invalid_message") -> Any:
    """Parse a client's JSON with bounded cost: parsing is linear (the C decoder; nesting past the interpreter's
    recursion limit raises at once), the nesting is measured on what it parsed, and integers longer than any field
    takes are refused while parsing (Python's int() is quadratic in the digits). Every string must be valid
    Unicode: JSON can carry a lone UTF-16 surrogate (\\ud800), which no encoder, tokenizer or log can take.
    Raises ProtocolError: `invalid_json`, or `code` for a value out of bounds."""
    value, suspect = _decode_json(raw, code)
    if suspect:
        _check_unicode(value, code)
    return value


def _decode_json(raw: str | bytes, code: str) -> tuple[Any, bool]:
    """JSON to Python, within the bounds of depth and integer size, each object's keys given once; and whether a
    string in it may hold a lone surrogate (not yet checked). The checks that walk the value in Python (~1 us an
    element: a 256 KB message of small values cost ~0.2-0.4 s of the event loop) run only where the text says they
    can find something; the repeated-key check is a call per object as it is parsed (~0.7 us a message; 256 KB of
    `{}` parses in ~43 ms instead of ~22: docs/benchmarks.md, twelfth session)."""
    text = _utf8_text(raw)
    repeated: list[tuple[dict[str, Any], str]] = []  # the first object found with a key given twice, and the key
    too_long: list[_LongInteger] = []
    options: dict[str, Any] = {"parse_constant": _no_constant, "object_pairs_hook": partial(_object_of, repeated)}
    if _LONG_DIGITS.search(text):  # an integer that long may be among them: each is checked as it is parsed
        options["parse_int"] = partial(_bounded_int, too_long)
    try:
        value = json.loads(text, **options)
    except json.JSONDecodeError as failure:
        raise ProtocolError("invalid_json", f"the message is not valid JSON: {failure}") from None
    except RecursionError:
        raise ProtocolError(code, f"JSON nested too deep; at most {MAX_JSON_DEPTH} levels are accepted") from None
    if too_long:
        raise _integer_too_long(code, too_long[0], value)
    if repeated:
        holder, key = repeated[0]
        _check_text(key, "a message key", code)  # a lone surrogate in it is named first (only the key: the depth is
        # not yet bounded)
        raise _repeated_key(code, key, top_level=holder is value)
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH:  # fewer brackets can neither nest deeper nor be many
        depth, containers = _shape(value)
        if containers > MAX_JSON_CONTAINERS:
            raise ProtocolError(code, f"a message holds at most {MAX_JSON_CONTAINERS} arrays and objects")
        if depth > MAX_JSON_DEPTH:
            raise ProtocolError(code, f"JSON nested more than {MAX_JSON_DEPTH} levels deep; at most "
                                      f"{MAX_JSON_DEPTH} are accepted")
    # the text itself encodes (`_utf8_text`): only a \uD800-\uDFFF escape can put a lone surrogate in a string
    return value, _SURROGATE_ESCAPE.search(text) is not None


def _utf8_text(raw: str | bytes) -> str:
    """The message as text, if its bytes are UTF-8. A text frame's bytes that are not arrive as lone surrogates
    (realtime.server), which no UTF-8 decoder yields, so such text does not encode back."""
    try:
        if isinstance(raw, bytes):
            return raw.decode("utf-8")
        if not raw.isascii():
            raw.encode("utf-8")
        return raw
    except UnicodeError:
        raise ProtocolError("invalid_json", "the message is not valid UTF-8 text") from None


def _shape(value: Any) -> tuple[int, int]:
    """The deepest nesting of arrays and objects in a parsed value, and how many there are, level by level without
    recursion, stopping once either passes its bound. (Measured on the text, with a regex skipping strings, the depth
    took quadratic time: 19 s for 80 KB of escaped quotes.)"""
    depth, containers, level = 0, 0, [value] if isinstance(value, dict | list) else []
    while level and depth <= MAX_JSON_DEPTH and containers <= MAX_JSON_CONTAINERS:
        depth += 1
        containers += len(level)
        children: list[Any] = []
        for item in level:
            children.extend(item.values() if isinstance(item, dict) else item)
        level = [child for child in children if isinstance(child, dict | list)]
    return depth, containers


class _LongInteger(str):
    """An integer too long for any field, left unconverted (Python's int() is quadratic in the digits)."""


def _bounded_int(too_long: list[_LongInteger], digits: str) -> int | _LongInteger:
    if len(digits.lstrip("-")) <= MAX_INTEGER_DIGITS:
        return int(digits)
    too_long.append(_LongInteger(digits))
    return too_long[-1]


def _integer_too_long(code: str, integer: _LongInteger, value: Any) -> ProtocolError:
    """The refusal of the first integer too long, naming its key where it is a top-level field's value (the
    message's fields are what an error's `param` names; a nested key of the same name is not one)."""
    failure = ProtocolError(code, f"an integer of {len(integer.lstrip('-'))} digits is out of range for every field")
    if isinstance(value, dict):
        failure.field = next((key[:MAX_NAME_CHARS] for key, item in value.items() if item is integer), None)
    return failure


def _object_of(repeated: list[tuple[dict[str, Any], str]], pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, noting in `repeated` the first one that gives a key twice: JSON leaves such an object's meaning
    to the reader (Python keeps the last value, other parsers the first), so a proxy and the server could read two
    different requests in one body."""
    value = dict(pairs)
    if len(value) < len(pairs) and not repeated:
        repeated.append((value, _twice_given(pairs)[0]))
    return value


def _twice_given(pairs: list[tuple[str, Any]]) -> list[str]:
    """The keys given more than once, in the order of their first repeat."""
    seen: set[str] = set()
    twice: dict[str, None] = {}
    for key, _ in pairs:
        if key in seen:
            twice[key] = None
        seen.add(key)
    return list(twice)


def _repeated_key(code: str, key: str, top_level: bool) -> ProtocolError:
    failure = ProtocolError(code, f"the key {key[:MAX_NAME_CHARS]!r} is given twice in one object; give each key once")
    if top_level:
        failure.field = key[:MAX_NAME_CHARS]
    return failure


def _no_constant(name: str) -> float:
    raise ProtocolError("invalid_json", f"{name} is not a JSON number")


def _check_unicode(value: Any, code: str, path: str = "message") -> None:
    """Refuses a lone surrogate in any string or key; one C pass (an encoding of the whole value), and a walk only to
    name where the one it found is (`path`: the value's name)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, TypeError, ValueError):  # a surrogate; or not JSON's types (a server-made message)
        _find_surrogate(value, code, path)


def valid_unicode(value: Any) -> bool:
    """Whether no string or key in `value` holds a lone surrogate."""
    try:
        _check_unicode(value, "invalid_message")
    except ProtocolError:
        return False
    return True


def _find_surrogate(value: Any, code: str, path: str = "message") -> None:
    if isinstance(value, str):
        _check_text(value, path, code)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, f"{path} key", code)
            try:
                _find_surrogate(item, code, key[:MAX_NAME_CHARS] if path == "message" else f"{path}.{key[:40]}")
            except ProtocolError as failure:
                if path == "message":
                    failure.field = key[:MAX_NAME_CHARS]
                raise
    elif isinstance(value, list):
        for item in value:
            _find_surrogate(item, code, f"{path}[]")


def _check_text(text: str, path: str, code: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as failure:
        raise ProtocolError(code, f"{path} is not valid Unicode text: it holds a lone surrogate "
                                  f"(U+{ord(text[failure.start]):04X})") from None


def parse_message(text: str, schemas: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = MESSAGES
                  ) -> dict[str, Any]:
    """A client text frame as a validated message dict (`schemas`: voxgate.v1's messages unless another socket's);
    raises ProtocolError (never fatal) carrying the message's `event_id` when it had a valid one."""
    try:
        message, suspect = _decode_json(text, "invalid_message")
    except ProtocolError as failure:
        if failure.code != "invalid_json":  # JSON, only out of bounds (digits, depth): its ids can still be named
            _name_its_message(failure, _read_leniently(text), context=schemas is MESSAGES)
        raise
    return check_message(message, schemas, check_unicode=suspect)


# Messages that end a context or stop it: past the rate they are still handled when they act on an open context (when
# small enough to read for free; the session decides), so that a client over its budget may lose text but never
# leaves a context open. Each acts once per context; a repeat, or one naming no open context, is dropped as any other
# (20,000 cancels of nothing in 1.6 s raised another session's ping to 34 ms). A flush is not among them: each one on
# an open context queues a marker and an encoder restart, which the rate must bound.
NEVER_DROPPED = frozenset({"context.end", "context.cancel"})


def _peek(text: str) -> dict[str, Any] | None:
    """A message past the rate as a JSON object, read only when it is at most `MAX_DROPPED_PEEK_BYTES` (a flood of
    large ones costs no parse); None otherwise, or when it is not one."""
    return None if len(text) > MAX_DROPPED_PEEK_BYTES else _read_leniently(text)


def _read_leniently(text: str) -> dict[str, Any] | None:
    """A JSON object read only for its top-level fields (no bound on depth; an integer too long for any field is
    read as None, unconverted); None where it is not one, or nests past the interpreter's recursion limit."""
    try:
        message = json.loads(text, parse_constant=_no_constant, parse_int=_short_int, object_pairs_hook=_unambiguous)
    except (ValueError, ProtocolError, RecursionError):
        return None
    return message if isinstance(message, dict) else None


def _unambiguous(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object without the keys it gives twice (an event_id given twice names no event)."""
    value = dict(pairs)
    if len(value) < len(pairs):
        for key in _twice_given(pairs):
            del value[key]
    return value


def _short_int(digits: str) -> int | None:
    return int(digits) if len(digits.lstrip("-")) <= MAX_INTEGER_DIGITS else None


def never_dropped(text: str) -> dict[str, Any] | None:
    """A message past the rate that is a small one of `NEVER_DROPPED`, read leniently (not validated); else None."""
    message = _peek(text)
    return message if message is not None and message.get("type") in NEVER_DROPPED else None


def dropped(text: str, reason: str) -> ProtocolError:
    """A `rate_limited` refusal of a message dropped unparsed, carrying its event_id and context_id where the message
    is small enough that reading them costs nothing (a dropped append must be told apart from the rest)."""
    return _name_its_message(ProtocolError("rate_limited", f"{reason}; this message was dropped"), _peek(text))


def _name_its_message(failure: ProtocolError, message: dict[str, Any] | None, context: bool = True) -> ProtocolError:
    """`failure` carrying the event_id (and with `context` the context_id: voxgate.v1's messages) of the message it
    refuses, where they are valid ones."""
    if message is not None:
        with contextlib.suppress(ProtocolError):  # a bad one is left out, not refused again
            failure.event_id = _event_id(message)
        if context:
            failure.context_id = _context_id(message)
    return failure


def check_message(message: Any, schemas: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = MESSAGES,
                  check_unicode: bool = True) -> dict[str, Any]:
    """A decoded message, validated as `parse_message` validates a text frame (a message the server makes on the
    client's behalf is checked by the very same rules, without a JSON round trip). `check_unicode`: False where its
    text showed that no string can hold a lone surrogate."""
    if not isinstance(message, dict):
        if check_unicode:
            _check_unicode(message, "invalid_message")
        raise ProtocolError("invalid_message", "a message must be a JSON object with a \"type\" field")
    event_id = _event_id(message)
    try:
        if check_unicode:
            # a session.start's fields are checked where each applies, a bad one refused alone (`configure`)
            _check_unicode({key: None if key in SESSION_START_FIELDS else value for key, value in message.items()}
                           if message.get("type") == "session.start" else message, "invalid_message")
        _check_fields(message, schemas)
    except ProtocolError as failure:
        failure.event_id = event_id
        if failure.context_id is None and schemas is MESSAGES:  # voxgate.v1: an error on a context's message
            failure.context_id = _context_id(message)  # names it (PROTOCOL.md: a refused first append too)
        raise
    return message


def _context_id(message: dict[str, Any]) -> str | None:
    """The message's context_id when it can be named in an error: a string of 1 to MAX_NAME_CHARS characters that is
    valid Unicode itself."""
    context_id = message.get("context_id")
    if not isinstance(context_id, str) or not 0 < len(context_id) <= MAX_NAME_CHARS:
        return None
    try:
        _check_text(context_id, "context_id", "invalid_message")
    except ProtocolError:
        return None
    return context_id


def _event_id(message: dict[str, Any]) -> Any:
    """The message's event_id when it is one (a short string or a finite number); a bad one is refused."""
    event_id = message.get("event_id")
    if event_id is None:
        return None
    if isinstance(event_id, str):
        _check_text(event_id, "event_id", "invalid_message")
    if isinstance(event_id, bool) or not isinstance(event_id, (str, int, float)) or _not_finite(event_id) or (
            isinstance(event_id, str) and len(event_id) > MAX_NAME_CHARS) or (
            not isinstance(event_id, str) and abs(event_id) >= 2**63):
        raise ProtocolError("invalid_message", f"event_id must be a string of at most {MAX_NAME_CHARS} characters "
                                               "or a finite number under 2**63")
    return event_id


def _check_fields(message: dict[str, Any], schemas: dict[str, dict[str, tuple[tuple[type, ...], bool]]]) -> None:
    kind = message.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("invalid_message", "the message has no \"type\" string")
    if kind not in schemas:
        raise ProtocolError("unknown_type", f"unknown message type {kind[:MAX_NAME_CHARS]!r}; expected one of: "
                                            f"{', '.join(schemas)}")
    context_id = message.get("context_id") if isinstance(message.get("context_id"), str) else None
    if context_id is not None and not 0 < len(context_id) <= MAX_NAME_CHARS:
        raise ProtocolError("invalid_message", f"context_id must be 1 to {MAX_NAME_CHARS} characters")
    for name, (types, required) in schemas[kind].items():
        value = message.get(name)
        if value is None:
            if required:
                given = "is null" if name in message else "is missing"
                raise ProtocolError("invalid_message", f"{kind}: field {name!r} {given}; it must be {_kinds(types)}",
                                    context_id=context_id)
            continue
        if _not_finite(value):  # JSON's 1e309 and beyond: a number Python reads as infinity
            raise ProtocolError("invalid_message", f"{kind}: field {name!r} is a number out of range (it must be "
                                                   "finite)", context_id=context_id)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types and types is not _ANY):
            raise ProtocolError("invalid_message", f"{kind}: field {name!r} must be {_kinds(types)}",
                                context_id=context_id)
        if types is not _ANY:
            check_limit(name, value, f"{kind}: ", context_id)
    if kind == "session.close" and message.get("mode") not in (None, "graceful", "abort"):  # null: absent
        raise ProtocolError("invalid_message", "session.close: mode must be \"graceful\" or \"abort\"")


def check_limit(name: str, value: Any, where: str = "", context_id: str | None = None,
                limits: dict[str, int | tuple[float, float]] = FIELD_LIMITS) -> None:
    """The one length / range rule of a field (`limits`: FIELD_LIMITS unless another endpoint's), for the socket and
    the speech endpoint alike; `where` prefixes the message. Raises ProtocolError (`text_too_long` for
    instructions, else `invalid_message`)."""
    limit = limits.get(name)
    if limit is None or isinstance(value, bool):
        return
    if isinstance(value, str) and isinstance(limit, int) and len(value) > limit:
        code = "text_too_long" if name == "instructions" else "invalid_message"
        raise ProtocolError(code, f"{where}{name} takes at most {limit} characters", context_id=context_id)
    if isinstance(value, (int, float)) and isinstance(limit, tuple) and not limit[0] <= value <= limit[1]:
        raise ProtocolError("invalid_message", f"{where}{name} must be from {limit[0]} to {limit[1]}",
                            context_id=context_id)


_TYPE_NAMES = {str: "a string", bool: "a boolean", dict: "an object", int: "a number", float: "a number",
               list: "an array", object: "any value"}


def _kinds(types: tuple[type, ...]) -> str:
    return " or ".join(dict.fromkeys(_TYPE_NAMES[t] for t in types))


def _not_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


# --- session configuration ---------------------------------------------------------------------------------------

class SessionChecks(Protocol):
    """What the served model accepts; the gateway's voice catalog answers (its checks raise ProtocolError)."""

    def check_voice(self, voice: str) -> str: ...

    def check_language(self, language: str) -> None: ...

    def takes_instructions(self, voice: str | None) -> bool: ...


class LexiconSource(Protocol):
    """Where a `lexicon` field's value becomes a lexicon: a stored one's name or rules given inline (the gateway's
    LexiconStore; raises LexiconError)."""

    def resolve(self, value: Any) -> Lexicon: ...


def configure(config: SessionConfig, fields: dict[str, Any], checks: SessionChecks | None = None,
              lexicons: LexiconSource | None = None) -> tuple[SessionConfig, list[ProtocolError]]:
    """`config` updated field by field from session.start fields or query parameters (the preset first, explicit
    fields over it); a bad field is refused with its error (`invalid_config` / `unsupported_format`) and keeps its
    previous value, the others apply. `checks` refuses a voice or language the model does not have, and instructions
    for a voice that takes none (`invalid_config`, as PROTOCOL.md's bad session field); `lexicons` resolves a
    `lexicon` field (without it the field is refused)."""
    errors = []
    for name in SESSION_START_FIELDS:  # a lone surrogate refuses its field alone (a session.start's are checked here)
        try:
            _check_unicode(fields.get(name), "invalid_config", name)
        except ProtocolError as failure:
            errors.append(failure)
            fields = {key: value for key, value in fields.items() if key != name}
    previous_instructions = config.instructions
    preset = fields.get("preset")
    if preset is not None:
        if isinstance(preset, str) and preset in PRESETS:
            config = _apply(config, PRESETS[preset], checks)
        else:
            errors.append(ProtocolError("invalid_config", f"unknown preset {_shown(preset)}; expected one of: "
                                                          f"{', '.join(PRESETS)}"))
    for name, value in fields.items():
        if name != "preset" and name in SESSION_FIELDS:
            try:
                config = _apply(config, {name: value}, checks)
            except ProtocolError as failure:
                errors.append(failure)
    given = fields.get("instructions")
    if isinstance(given, str) and given.strip() and config.instructions == given and checks is not None \
            and not checks.takes_instructions(config.voice):
        voice = f"the voice {config.voice!r}" if config.voice else "this model's default voice"
        errors.append(ProtocolError("invalid_config", f"{voice} takes no instructions (a stored voice keeps its own; "
                                                      "a Base model's voices and a 0.6B CustomVoice model's speakers "
                                                      "take none); they were not applied"))
        config = replace(config, instructions=previous_instructions)
    if fields.get("lexicon") is not None:
        try:
            config = replace(config, lexicon=lexicon_of(fields["lexicon"], lexicons, "invalid_config"))
        except ProtocolError as failure:
            errors.append(failure)
    return config, errors


TIMESTAMPS = ("none", "word")


def lexicon_of(value: Any, lexicons: LexiconSource | None, code: str, context_id: str | None = None) -> Lexicon:
    """A `lexicon` field (a stored lexicon's name or inline rules) as a lexicon; raises ProtocolError(`code`)."""
    if lexicons is None:
        raise ProtocolError(code, "lexicons are not available here", context_id=context_id)
    try:
        return lexicons.resolve(value)
    except LexiconsBusy as failure:  # not the client's fault: the server holds as many as it can now
        raise ProtocolError("overloaded", f"lexicon: {failure}", context_id=context_id) from None
    except LexiconError as failure:
        raise ProtocolError(code, f"lexicon: {failure}", context_id=context_id) from None


def _shown(value: Any) -> str:
    """A client's value in an error message, cut short."""
    return repr(value)[:60]


def _apply(config: SessionConfig, fields: dict[str, Any], checks: SessionChecks | None) -> SessionConfig:
    for name in ("voice", "language", "instructions"):
        if fields.get(name) is not None:
            config = replace(config, **{name: _session_string(name, fields[name], checks)})
    if fields.get("audio") is not None:
        config = replace(config, audio=_audio(config.audio, _object(fields["audio"], "audio")))
    if fields.get("transport") is not None:
        transport = _given(_object(fields["transport"], "transport"), "audio", config.transport)
        if not isinstance(transport, str) or transport not in TRANSPORTS:
            raise ProtocolError("invalid_config", f"transport.audio must be one of: {', '.join(TRANSPORTS)}")
        config = replace(config, transport=transport)
    if fields.get("text") is not None:
        config = _text(config, _object(fields["text"], "text"))
    if fields.get("sampling") is not None:
        config = replace(config, sampling=_sampling(config.sampling, _object(fields["sampling"], "sampling")))
    if fields.get("timestamps") is not None:
        if not isinstance(fields["timestamps"], str) or fields["timestamps"] not in TIMESTAMPS:
            raise ProtocolError("invalid_config", f"timestamps must be one of: {', '.join(TIMESTAMPS)}")
        config = replace(config, timestamps=fields["timestamps"])
    return config


def _session_string(name: str, value: Any, checks: SessionChecks | None) -> str:
    """voice / language / instructions of a session: a string within its limit that the model accepts."""
    if not isinstance(value, str) or (name != "instructions" and not value.strip()):
        raise ProtocolError("invalid_config", f"{name} must be a non-empty string")
    limit = MAX_INSTRUCTIONS_CHARS if name == "instructions" else MAX_NAME_CHARS
    if len(value) > limit:
        raise ProtocolError("text_too_long" if name == "instructions" else "invalid_config",
                            f"{name} takes at most {limit} characters")
    if checks is not None and name == "voice":
        return checks.check_voice(value)  # as the model names it
    if checks is not None and name == "language":
        checks.check_language(value)
    return value


def _object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError("invalid_config", f"{name} must be an object")
    return value


def _given(fields: dict[str, Any], name: str, default: Any) -> Any:
    """A field's value; absent or null, `default` (null means "not given", as for every optional field)."""
    value = fields.get(name)
    return default if value is None else value


def _audio(current: AudioFormat, fields: dict[str, Any]) -> AudioFormat:
    encoding = _given(fields, "encoding", current.encoding)
    if not isinstance(encoding, str):
        raise ProtocolError("invalid_config", "audio.encoding must be a string naming an encoding")
    if len(encoding) > MAX_NAME_CHARS:
        raise ProtocolError("unsupported_format", f"audio.encoding takes at most {MAX_NAME_CHARS} characters; no "
                                                  "encoding's name is that long")
    rate = fields.get("sample_rate")
    if rate is None:  # a new encoding without a rate takes that encoding's default rate
        rate = current.sample_rate if encoding == current.encoding else DEFAULT_RATES.get(encoding, 0)
    bitrate = fields.get("bitrate")
    if bitrate is None:  # kept from before; one another encoding ignored does not follow into opus
        low, high = OPUS_BITRATES
        bitrate = current.bitrate if encoding != "opus" or low <= current.bitrate <= high else AudioFormat().bitrate
    values = dict(encoding=encoding, sample_rate=rate, frame_ms=_given(fields, "frame_ms", current.frame_ms),
                  bitrate=bitrate)
    for name, value in values.items():
        wanted = str if name == "encoding" else int
        if isinstance(value, bool) or not isinstance(value, wanted):
            if wanted is int and isinstance(value, float):
                if value.is_integer():
                    values[name] = int(value)
                    continue
                raise ProtocolError("invalid_config", f"audio.{name} must be a whole number, not {value!r}")
            raise ProtocolError("invalid_config", f"audio.{name} must be {_TYPE_NAMES[wanted]}")
    try:
        return AudioFormat(**values).check()
    except UnsupportedFormat as failure:
        raise ProtocolError("unsupported_format", str(failure)) from None


def _text(config: SessionConfig, fields: dict[str, Any]) -> SessionConfig:
    buffering = _given(fields, "buffering", config.buffering)
    if not isinstance(buffering, str) or buffering not in BUFFERING:
        raise ProtocolError("invalid_config", f"text.buffering must be one of: {', '.join(BUFFERING)}")
    delay = _given(fields, "max_buffer_delay_ms", config.max_buffer_delay_ms)
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay <= 10000:
        raise ProtocolError("invalid_config", "text.max_buffer_delay_ms must be a number from 0 to 10000")
    return replace(config, buffering=buffering, max_buffer_delay_ms=int(delay))


_SAMPLING_RANGES = {"temperature": (float, 0.0, 5.0), "top_k": (int, 0, 10000), "top_p": (float, 0.0, 1.0),
                    "repetition_penalty": (float, 0.5, 5.0), "seed": (int, 0, MAX_SEED)}


def sampling_value(name: str, value: Any, label: str | None = None) -> int | float:
    """One sampling field (`name` in _SAMPLING_RANGES) checked and converted, by the socket's and the HTTP API's
    one rule: a JSON number in range, an integer field also as an integral float (`42.0`, what some JSON writers
    send). Raises ProtocolError(invalid_config) naming it as `label` (default `sampling.<name>`)."""
    kind, low, high = _SAMPLING_RANGES[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or _not_finite(value) or not (
            low <= value <= high) or (kind is int and not float(value).is_integer()):
        what = "an integer" if kind is int else "a number"
        raise ProtocolError("invalid_config", f"{label or 'sampling.' + name} must be {what} from {low} to {high}")
    return kind(value)


def _sampling(current: Sampling, fields: dict[str, Any]) -> Sampling:
    values = {name: sampling_value(name, fields[name]) for name in _SAMPLING_RANGES if fields.get(name) is not None}
    if "top_p" in values and values["top_p"] == 0.0:
        raise ProtocolError("invalid_config", "sampling.top_p must be greater than 0")
    return replace(current, **values)


QUERY_PARAMETERS = ("voice", "language", "preset", "encoding", "sample_rate")


def query_fields(items: list[tuple[str, str]]) -> tuple[list[dict[str, Any]], list[ProtocolError]]:
    """Session defaults from the socket's query string (its (name, value) pairs in order), in session.start's shape,
    as steps for `configure` in turn (a rate after its encoding: each parameter is applied on its own, so
    `?encoding=mulaw&sample_rate=16000` keeps mu-law at its own rate and refuses the rate alone), and the errors of
    bad ones. A parameter given twice is refused, as a repeated JSON key is: which one was meant is a guess."""
    counts = Counter(name for name, _ in items)
    params = {name: value for name, value in items if counts[name] == 1}
    errors = [ProtocolError("invalid_config", f"the query parameter {name!r} is given {counts[name]} times; give it "
                                              f"once") for name in QUERY_PARAMETERS if counts[name] > 1]
    fields: dict[str, Any] = {k: params[k] for k in ("voice", "language", "preset") if k in params}
    steps = [fields]
    if "encoding" in params:
        fields["audio"] = {"encoding": params["encoding"]}
    if "sample_rate" in params:
        rate = params["sample_rate"]
        # ASCII digits only: int() also takes "16_000", "+16000", spaces and other scripts' digits
        if rate.isascii() and rate.isdigit() and len(rate) <= MAX_INTEGER_DIGITS:
            steps.append({"audio": {"sample_rate": int(rate)}})
        else:
            shown = repr(rate[:20]) + (f" ({len(rate)} characters)" if len(rate) > 20 else "")
            errors.append(ProtocolError("invalid_config", f"sample_rate must be a whole number of Hz in ASCII digits, "
                                                          f"not {shown}"))
    return steps, errors


class SessionLimits(Protocol):
    """The limits `session.started` announces (the gateway's `Limits`)."""
    max_contexts: int
    max_text_chars: int
    max_message_bytes: int
    idle_timeout_s: float


def session_started(session_id: str, model: str, voice: str, config: SessionConfig, pre_skip: int,
                    limits: SessionLimits, event_id: Any = None) -> dict[str, Any]:
    """The `session.started` event: the session's effective configuration and its limits. `voice` and `lexicon`
    are always there, null when there is none (a Base model with no voice yet; no lexicon)."""
    started = event("session.started", session_id=session_id, protocol=PROTOCOL, model=model, voice=voice,
                 audio=audio_description(config.audio, pre_skip), transport={"audio": config.transport},
                 text={"buffering": config.buffering, "max_buffer_delay_ms": config.max_buffer_delay_ms},
                 timestamps=config.timestamps, lexicon=lexicon_description(config.lexicon),
                 limits={"max_contexts": limits.max_contexts, "max_text_chars": limits.max_text_chars,
                         "max_message_bytes": limits.max_message_bytes, "idle_timeout_s": limits.idle_timeout_s},
                 event_id=event_id)
    return started | {name: None for name in ("voice", "lexicon") if name not in started}


def lexicon_description(lexicon: Lexicon | None) -> dict[str, Any] | None:
    """What `session.started` says of the session's lexicon: its name (null when given inline) and its size."""
    return None if lexicon is None else {"name": lexicon.name, "rules": len(lexicon.rules)}


def audio_description(fmt: AudioFormat, pre_skip: int) -> dict[str, Any]:
    described = {"encoding": fmt.encoding, "sample_rate": fmt.sample_rate, "frame_ms": fmt.frame_ms, "channels": 1}
    if fmt.encoding == "opus":
        described.update(bitrate=fmt.bitrate, pre_skip=pre_skip)
    return described
