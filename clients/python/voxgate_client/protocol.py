"""voxgate.v1 on the wire (PROTOCOL.md): the binary audio header, client messages, and the opening of a session,
which the client and the framework plugins share.

A session opens with a `session.started` the server sends unasked; a `session.start` is answered by a second one
(its `event_id` echoed), after an `error` for each field it refused. `handshake` waits for both, so a plugin never
mistakes the first for the configuration it asked for.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import struct
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

MAGIC = 0xA1
FLAG_FIRST, FLAG_LAST, FLAG_DISCONTINUITY = 1, 2, 4
HEADER = struct.Struct("<BBHI")
PCM_SAMPLE_RATES = (8000, 16000, 22050, 24000, 44100, 48000)  # PROTOCOL.md "Formats", pcm_s16le
# session.start errors after which the server still answers with session.started (the other fields applied)
CONFIG_ERRORS = frozenset({"invalid_config", "unsupported_format"})
# errors that refuse a context's text itself: sent again, the same text gets them again (not worth a retry)
TEXT_REFUSALS = frozenset({"empty_text", "text_too_long", "invalid_message"})
_start_ids = itertools.count(1)
# The HTTP status a refusal's code stands for (the speech endpoint answers with these; a socket's refusal carries only
# the code): what frameworks tell a lasting failure (401, 400) from one worth retrying (503, 429) by. "closed": the
# server closed the socket before it said anything (it is stopping).
_STATUS_OF_CODE = {"unauthorized": 401, "unknown_voice": 404, "rate_limited": 429, "internal": 500,
                   "synthesis_failed": 500, "overloaded": 503, "closed": 503}


class ServerError(Exception):
    """An `error` event the client cannot carry on from (e.g. a refused session.start)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message

    @property
    def status_code(self) -> int:
        """The HTTP status its code stands for (`http_status`), where frameworks look for one to classify it."""
        return http_status(self.code)


def http_status(code: str) -> int:
    """The HTTP status of a server error code: 400 for the codes of a request it will not take as it is."""
    return _STATUS_OF_CODE.get(code, 400)


class VoxgateRefused(ServerError):
    """The server refused the session: one fatal error, then the close (4001 unauthorized, 1013 overloaded)."""

    def __init__(self, code: str, message: str, close_code: int | None) -> None:
        super().__init__(code, message)
        self.close_code = close_code


def primary_language(language: str | None) -> str | None:
    """The server takes a language's name or its ISO code ("en"); a regional tag, as LiveKit and Pipecat write
    them ("en-US", "zh-Hans"), loses its region."""
    return None if language is None else str(language).split("-")[0]


def parse_frame(data: bytes) -> tuple[int, int, int, bytes]:
    """(flags, stream_id, pts, payload) of a binary audio frame."""
    if len(data) < HEADER.size:
        raise ValueError(f"an audio frame of {len(data)} bytes is shorter than its header")
    magic, flags, stream_id, pts = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"not a voxgate.v1 audio frame (magic {magic:#x})")
    return flags, stream_id, pts, data[HEADER.size:]


def client_message(type_: str, **fields: Any) -> str:
    """A client message as sent: fields that are None are left out."""
    return json.dumps({"type": type_, **{k: v for k, v in fields.items() if v is not None}})


def auth_headers(api_key: str | None) -> dict[str, str] | None:
    return {"Authorization": f"Bearer {api_key}"} if api_key else None


def keepalive_interval_s(session: dict[str, Any]) -> float:
    """How often an idle connection sends `keepalive`: four times within the server's idle timeout."""
    return session["limits"]["idle_timeout_s"] / 4


def check_pcm_rate(sample_rate: int) -> None:
    """A framework's output rate must be one the server sends PCM at (no resampling in the plugins)."""
    if sample_rate not in PCM_SAMPLE_RATES:
        raise ValueError(f"voxgate sends pcm_s16le at {', '.join(map(str, PCM_SAMPLE_RATES))} Hz, "
                         f"not {sample_rate}: set the pipeline's output rate to one of them")


async def receive_session_started(ws: ClientConnection) -> dict[str, Any]:
    """The session.started that opens every session, or the refusal that replaces it (raised as VoxgateRefused)."""
    try:
        first = json.loads(await ws.recv())
    except ConnectionClosed:
        raise VoxgateRefused("closed", "the server closed the socket before session.started",
                             ws.close_code) from None
    if first.get("type") == "session.started":
        return first
    if first.get("type") == "error":
        with contextlib.suppress(ConnectionClosed):
            await ws.recv()  # the close that follows a refusal
        await ws.wait_closed()
        raise VoxgateRefused(first.get("code", ""), first.get("message", ""), ws.close_code)
    raise ServerError("invalid_message", f"expected session.started, got {first.get('type')!r}")


async def handshake(ws: ClientConnection, **start_fields: Any) -> dict[str, Any]:
    """Wait for the opening session.started, send `session.start` with `start_fields`, and return the second
    session.started that answers it; a field the server refuses raises ServerError (its code), since a plugin must
    not go on at a rate or format it did not ask for."""
    await receive_session_started(ws)
    event_id = f"handshake-{next(_start_ids)}"
    await ws.send(client_message("session.start", event_id=event_id, **start_fields))
    while True:
        answer = json.loads(await ws.recv())
        if answer.get("event_id") != event_id:
            continue
        if answer.get("type") == "error":
            raise ServerError(answer.get("code", ""), answer.get("message", ""))
        if answer.get("type") == "session.started":
            return answer
