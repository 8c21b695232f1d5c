"""Running the app under uvicorn: WebSocket compression off, the message size limit, pings for dead peers, a write
buffer that a pong and a blocked send can wait on together, and a shutdown that lets sessions finish or cancel their
contexts before uvicorn closes the sockets (HTTP/1.1's guards: `realtime.http_transport`), and logs that never
hold an API key."""
from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import struct
import warnings
from http import HTTPStatus
from collections import deque
from typing import Any
from urllib.parse import unquote_plus

import uvicorn

from engine.errors import VoxgateError
from realtime.app import WEB_DIR, create_app, drain
from realtime.errors import HTTPFailure
from realtime.gateway import Gateway, GatewayOptions, check_options
from realtime.http_transport import GuardedH11Protocol, bytes_acked
from realtime.metrics import TransportMetrics
from realtime.ws import protocol as ws_protocol

# uvicorn's legacy websockets protocol, on purpose: its sans-I/O one (uvicorn 0.54) closes the TCP connection right
# after the 1009 close frame of an oversized message while the client is still sending, so the client gets a reset
# instead of the close code (tests/test_hostile_client.py). Imported here with its deprecation notices silenced.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="The `websockets` implementation is deprecated")
    warnings.filterwarnings("ignore", message="websockets.legacy is deprecated")
    from uvicorn.protocols.websockets.websockets_impl import WebSocketProtocol
    from websockets.datastructures import Headers
    from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidUpgrade, ProtocolError
    from websockets.legacy.exceptions import AbortHandshake
    from websockets.frames import DATA_OPCODES, CloseCode, Frame, Opcode
    from websockets.legacy.protocol import MAX_FRAGMENTS, TooManyFragments
    from websockets.protocol import State



MAX_HELD_BYTES = 16_384  # a loop turn's data frames held for one socket write: a 320 ms chunk of 24 kHz PCM


DATA_HEAD = struct.Struct("!BB")
DATA_HEAD_16 = struct.Struct("!BBH")
DATA_HEAD_64 = struct.Struct("!BBQ")


def data_frame(message: str | bytes) -> bytes:
    """One whole message as a server's data frame (RFC 6455: FIN, text or binary, unmasked, the length in 7, 16 or 64
    bits). No extension applies: compression is off (`build_server`), and a frame without RSV1 is an uncompressed
    message under permessage-deflate too."""
    if isinstance(message, str):
        opcode, data = 0x81, message.encode()
    else:
        opcode, data = 0x82, message
    length = len(data)
    if length < 126:
        return DATA_HEAD.pack(opcode, length) + data
    if length < 65536:
        return DATA_HEAD_16.pack(opcode, 126, length) + data
    return DATA_HEAD_64.pack(opcode, 127, length) + data


def _let_go(task: asyncio.Future) -> None:
    """Cancel `task`, or, where it has ended with an exception, take it: nothing left to log 'Task exception was
    never retrieved' (a hostile try: a client reset during a keepalive's wait logged two tracebacks each time)."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()


class GatewayWebSocketProtocol(WebSocketProtocol):
    """uvicorn's legacy protocol, three things changed.

    A write buffer that several writers may wait on at once. Its own flow control keeps
    one waiter and asserts there is no other, but a client that reads slowly makes two writers wait together: the
    session's send of audio and the pong that answers the client's ping (or a keepalive ping, or a close frame).
    The assertion then failed the connection with 1011, ahead of the slow-consumer policy's error and 1008. Here
    every waiter waits its turn, as asyncio's own streams do.

    A text message that is not valid UTF-8 reaches the session, which answers it with a non-fatal error as it does
    any malformed message (`read_message`); the library failed the connection with 1007 and no word why.

    A session ends as soon as nothing more can arrive on its socket (`ensure_open`), while the connection stays
    until the protocol has closed it (`_app_then_close`).

    And the messages written in one turn of the event loop leave in one socket write (`write_frame_sync`).

    And a handshake's headers reach the app as the bytes that were sent (`process_request`); a refused one gets the
    API's JSON error (`handshake`).

    And a connection logs on SOCKET_LOG, whose INFO lines (three a session: open, accepted, closed) are off unless the
    log level is debug: a client opening and closing sessions in a loop wrote three lines a socket, and a storm of
    512 sessions spent 13% of the event loop's samples writing them (docs/benchmarks.md, "The session storm's log
    lines"). Warnings and errors stay.

    And a ping left unanswered closes the session as a slow consumer (`keepalive_ping`)."""

    errors: TransportMetrics | None = None  # the gateway's socket errors, the keepalive's close counted (`_counting`)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._drain_waiters: deque[asyncio.Future[None]] = deque()
        self._held: list[bytes] = []
        self._held_bytes = 0
        super().__init__(*args, **kwargs)
        self.logger = SOCKET_LOG
        self._session_app, self.app = self.app, self._app_then_close

    def write_frame_sync(self, fin: bool, opcode: int, data: Any) -> None:
        """A data frame is held to the loop turn's end (`_write_data`); a control frame (close, ping, pong) writes
        what is held, then itself, at once."""
        frame = Frame(Opcode(opcode), data, fin).serialize(mask=self.is_client, extensions=self.extensions)
        if opcode in DATA_OPCODES:
            self._write_data(frame)
            return
        self._write_held()
        self.transport.write(frame)

    def _write_data(self, frames: bytes) -> None:
        """A chunk of audio is several 20 ms packets, each its own message: a system call and a TCP segment each was
        the larger part of the gateway's cost per message (docs/benchmarks.md). Data frames are therefore held until
        the end of the loop's turn and written together, in order.

        Only while the socket keeps up, and only up to `MAX_HELD_BYTES`: once the transport buffers (the peer reads
        slowly), every frame goes to it at once, so that its high-water mark pauses the sender as before and the
        session's send queue, not the transport, holds what waits (its urgent events, cancels and slow-consumer
        policy act on it)."""
        if not self.transport.get_write_buffer_size() and self._held_bytes + len(frames) <= MAX_HELD_BYTES:
            if not self._held:
                self.loop.call_soon(self._write_held)
            self._held.append(frames)
            self._held_bytes += len(frames)
            return
        self._write_held()
        self.transport.write(frames)

    async def keepalive_ping(self) -> None:
        """The library's keepalive, three things changed. The ping's own send counts against the pong's timeout: it
        waited without bound behind audio the client did not read. A pong that does not come ends the session
        under the slow-consumer policy (PROTOCOL.md, Backpressure: `error{slow_consumer, fatal}`, then 1008), not
        with 1011, which says the server failed: a client library answers pings as it reads, so a client that
        answers none reads nothing. And the pong is waited for as long as the client keeps taking data (its TCP
        acknowledges more of it each timeout, `bytes_acked`): the server makes audio faster than real time, so a
        client that plays it as it reads has tens of seconds of it queued ahead of the ping in the sockets' buffers
        (a hostile try: such a client was cut off 40 s into a long answer)."""
        if self.ping_interval is None:
            return
        try:
            while True:
                await asyncio.sleep(self.ping_interval)
                acked = bytes_acked(self.transport)
                pong = asyncio.ensure_future(self._ping_answered())
                try:
                    while not (await asyncio.wait({pong}, timeout=self.ping_timeout))[0]:
                        now_acked = bytes_acked(self.transport)
                        if acked is None or now_acked is None or now_acked <= acked:
                            self._close_unread()
                            return
                        acked = now_acked
                    pong.result()
                finally:  # this task cancelled (the connection lost) while the pong was awaited: the pong's goes too
                    _let_go(pong)
        except ConnectionClosed:
            pass
        except Exception:  # as the library does: a failed keepalive is logged, never left in an unawaited task
            self.logger.error("keepalive ping failed", exc_info=True)

    async def _ping_answered(self) -> None:
        await (await self.ping())

    def _close_unread(self) -> None:
        failure = ws_protocol.ProtocolError("slow_consumer", f"the client answered no ping for {self.ping_timeout:g} "
                                                             "s: it reads nothing; closing", fatal=True)
        if self.errors is not None:
            self.errors.error(failure.code)
        if self.state is State.OPEN:  # behind what the client has not read yet, like the close frame
            self.write_frame_sync(True, Opcode.TEXT, json.dumps(ws_protocol.error_event(failure)).encode())
        self.fail_connection(CloseCode.POLICY_VIOLATION, "slow_consumer")

    async def process_request(self, path: str, request_headers: Headers) -> Any:
        """The library decodes header bytes that are not ASCII with `surrogateescape`, and uvicorn's latin-1 encoding
        of them failed the handshake with a 500 and a traceback (a browser's UTF-8 cookie did): each value is given
        here as the latin-1 text of its bytes, which uvicorn encodes back to them."""
        headers = Headers((name, value.encode("ascii", "surrogateescape").decode("latin-1"))
                          for name, value in request_headers.raw_items())
        return await super().process_request(path, headers)

    async def handshake(self, *args: Any, **kwargs: Any) -> str:
        """A request the library refuses as a handshake (a malformed head, no key, another version, no upgrade)
        gets the API's JSON error with the library's reason, not its plain text."""
        try:
            return await super().handshake(*args, **kwargs)
        except AbortHandshake:
            raise
        except InvalidHandshake as refused:
            status = HTTPStatus.UPGRADE_REQUIRED if isinstance(refused, InvalidUpgrade) else HTTPStatus.BAD_REQUEST
            failure = HTTPFailure(status, "invalid_message", f"not a WebSocket handshake: {refused}")
            headers = [("Content-Type", "application/json")] + ([("Upgrade", "websocket")] if status == 426 else [])
            raise AbortHandshake(status, headers, json.dumps(failure.body()).encode()) from refused

    async def read_message(self) -> str | bytes | None:
        """The library's reassembly of a message from its frames, with one change: a text message's bytes are
        decoded with Python's `surrogateescape`, so bytes that are not UTF-8 arrive as lone surrogates (which valid
        UTF-8 never yields) and the session refuses the message with `invalid_json` (realtime.ws.protocol)."""
        frame = await self.read_data_frame(max_size=self.max_size)
        if frame is None:  # a close frame
            return None
        if frame.opcode is Opcode.CONT:
            raise ProtocolError("unexpected opcode")
        text = frame.opcode is Opcode.TEXT
        fragments = [frame.data]
        size = len(frame.data)
        while not frame.fin:
            frame = await self.read_data_frame(max_size=None if self.max_size is None else self.max_size - size)
            if frame is None:
                raise ProtocolError("incomplete fragmented message")
            if frame.opcode is not Opcode.CONT:
                raise ProtocolError("unexpected opcode")
            if len(fragments) >= MAX_FRAGMENTS:
                raise TooManyFragments(MAX_FRAGMENTS)
            fragments.append(frame.data)
            size += len(frame.data)
        data = b"".join(fragments)
        return data.decode("utf-8", "surrogateescape") if text else data

    def _write_held(self) -> None:
        held, self._held, self._held_bytes = self._held, [], 0
        if held and not self.transport.is_closing():
            self.transport.write(b"".join(held))

    async def _drain_helper(self) -> None:
        if self.connection_lost_waiter.done():
            raise ConnectionResetError("Connection lost")
        if not self._paused:
            return
        waiter = self.loop.create_future()
        self._drain_waiters.append(waiter)
        try:
            await waiter
        finally:
            self._drain_waiters.remove(waiter)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._wake_writers(None)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._wake_writers(exc)

    def _wake_writers(self, exc: Exception | None) -> None:
        for waiter in self._drain_waiters:
            if not waiter.done():
                if exc is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(exc)

    @property
    def _receiving_ended(self) -> bool:
        """The opening handshake completed and nothing more can arrive (the data transfer task has ended)."""
        return self.state in (State.OPEN, State.CLOSING) and self.transfer_data_task.done()

    async def ensure_open(self) -> None:
        """Once nothing more can be received (the peer's close frame arrived, or the protocol failed the connection:
        a message over the size limit, a ping unanswered), say so at once. The legacy protocol waits for the TCP close
        first, up to its 10 s close timeout, so a peer that kept its socket open after a close held a session open
        (and a place under `max_sessions`) that long. The app then hears close code 1005 (the peer's code is known
        only once the TCP close is done); nothing in the gateway reads it."""
        if self._receiving_ended:
            raise self.connection_closed_exc()
        await super().ensure_open()

    def _write_now(self, text: str) -> None:
        """A text message written at once, behind what the peer has not read yet and ahead of the close frame: a
        session's last words when its sender waits on a peer that reads nothing (`Session.abort`). Given to the
        session in its scope's extensions (`WRITE_NOW_EXTENSION`)."""
        if self.state is State.OPEN:
            self.write_frame_sync(True, Opcode.TEXT, text.encode())

    def _send_now(self, messages: list[str | bytes]) -> bool:
        """Data messages written at once (held to the loop turn's end, `_write_data`) when the ordinary send would not
        wait: the connection is open, receiving goes on and the transport is not paused. An Opus stream is 50
        messages a second, and starlette's, uvicorn's and the legacy protocol's layers of awaits around each cost ~40%
        of the web stack's time a message (docs/benchmarks.md, "Sends past the ASGI layers"); a chunk's messages are
        framed here in one go (`data_frame`).
        False: nothing was written; the caller sends them the ordinary way, which waits for room or raises what the
        connection's state says. Given to the session in its scope's extensions (`SEND_NOW_EXTENSION`)."""
        if self.state is not State.OPEN or self._receiving_ended or self._paused:
            return False
        self._write_data(b"".join(map(data_frame, messages)))
        return True

    async def _app_then_close(self, scope: Any, receive: Any, send: Any) -> None:
        """The session, then, where it ended because nothing more could arrive (`ensure_open`), the protocol's own
        close of the connection (its close timeout bounds it) before uvicorn closes the transport: closed at once,
        a peer still sending a message over the size limit got a reset instead of the 1009 close frame on its way.
        The session's scope carries `_write_now` and `_send_now`."""
        extensions = {**scope.get("extensions", {}), ws_protocol.WRITE_NOW_EXTENSION: self._write_now,
                      ws_protocol.SEND_NOW_EXTENSION: self._send_now}
        await self._session_app({**scope, "extensions": extensions}, receive, send)
        if self._receiving_ended:
            await asyncio.shield(self.close_connection_task)


PING_INTERVAL_S = 20.0
PING_TIMEOUT_S = 20.0
SOCKET_LOG = logging.getLogger("voxgate.sockets")
LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi", "voxgate", SOCKET_LOG.name)


# a parameter's name stops at the next separator (`?` too), so the names tried from each separator never overlap and
# a line costs linear time: a name that could run on over later `?` made "?" * 15,000 take seconds of the event loop
_PARAM_NAME = re.compile(r"([?&;])([^=&;?#\s\"']*)=")
# a secret's value runs to the next `&` or space, as the query parser reads it (a key may hold `;`, `#` or quotes:
# stopping there logged the rest of it, a hostile try)
_SECRET_VALUE = re.compile(r"[^&\s]*")


def redact(text: str) -> str:
    """`text` with the value of every query parameter named like a secret (SECRET_NAMES: `token`, `api_key`,
    `password`, `auth`, ..., percent-encoded or not) replaced: uvicorn logs each request's path with its query
    string, and a client may put its key where the API does not read it. One pass: a name is looked for after the
    last one, or after the redacted value."""
    pieces, kept_from, position = [], 0, 0
    while (name := _PARAM_NAME.search(text, position)) is not None:
        position = name.end()
        if unquote_plus(name[2]).lower().endswith(SECRET_NAMES):
            pieces += [text[kept_from:position], "[redacted]"]
            kept_from = position = _SECRET_VALUE.match(text, position).end()
    return "".join(pieces) + text[kept_from:]


# a query parameter whose name ends with one of these holds a secret (`token`, `api_key`, `client_secret`, `passwd`)
SECRET_NAMES = ("token", "key", "secret", "password", "passwd", "auth", "authorization", "bearer", "signature",
                "credential", "credentials")


MAX_LOGGED_ARGUMENT = 1000  # characters of one logged value (a request's path and query): a 70 KB query was one line


def bounded(text: str) -> str:
    """`text`, cut to MAX_LOGGED_ARGUMENT characters, saying how long it was."""
    return text if len(text) <= MAX_LOGGED_ARGUMENT else f"{text[:MAX_LOGGED_ARGUMENT]}... ({len(text)} characters)"


class RedactSecrets(logging.Filter):
    """Rewrites a record's message and string arguments in place, redacted and bounded (uvicorn's access formatter
    reads the arguments one by one, so they stay a tuple of the same length)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(bounded(redact(arg)) if isinstance(arg, str) else arg for arg in record.args)
        return True


_REDACT_SECRETS = RedactSecrets()


def redact_logs() -> None:
    """A logger's filters see only the records logged on it, not its children's: each logger that logs gets one."""
    for name in LOGGERS:
        logging.getLogger(name).addFilter(_REDACT_SECRETS)


def check_bindable(host: str, port: int) -> None:
    """Fails at once, before the model loads, when the address cannot be listened on (a port in use, a bad host)."""
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                  flags=socket.AI_PASSIVE):
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's create_server does
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind(address)
    except OSError as failure:
        raise VoxgateError(f"cannot listen on {host}:{port}: {failure.strerror or failure}") from None


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.exit_code = 0

    def fail(self, reason: str) -> None:
        """The gateway's fatal error (the model did not load, the engine died for good; it logged why): drain,
        exit, and report it in the exit status."""
        self.exit_code = 1
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        await drain(self.gateway)
        await super().shutdown(sockets)


def _counting(gateway: Gateway) -> type[GatewayWebSocketProtocol]:
    """The protocol class of this gateway's server: its sockets' errors count in the gateway's metrics."""
    class WebSocketProtocol(GatewayWebSocketProtocol):
        errors = gateway.metrics.socket
    return WebSocketProtocol


def build_server(options: GatewayOptions, host: str = "127.0.0.1", port: int = 8000,
                 log_level: str = "info") -> _Server:
    gateway = Gateway(options)
    limits = gateway.limits

    def protocol(*args: Any, **kwargs: Any) -> GuardedH11Protocol:
        # the gateway's limits of now: the session limit, and the connection cap with it, follow the engine's slots
        return GuardedH11Protocol(*args, **kwargs, handshake_timeout_s=limits.handshake_timeout_s,
                                  max_connections=gateway.limits.connection_cap)

    config = uvicorn.Config(create_app(gateway), host=host, port=port, log_level=log_level, http=protocol,
                            ws=_counting(gateway), ws_max_size=limits.max_message_bytes,
                            ws_per_message_deflate=False, ws_ping_interval=PING_INTERVAL_S, ws_ping_timeout=PING_TIMEOUT_S,
                            timeout_graceful_shutdown=10)
    redact_logs()  # after uvicorn.Config, which configures uvicorn's loggers
    SOCKET_LOG.setLevel(logging.DEBUG if log_level in ("debug", "trace") else logging.WARNING)
    server = _Server(config, gateway)
    gateway.on_fatal = server.fail
    return server


def serve(options: GatewayOptions, host: str, port: int, log_level: str = "info") -> int:
    """Runs until stopped; the exit status is non-zero when the gateway failed for good. `log_level`: debug,
    info, warning or error (debug adds each WebSocket connection's open, accepted and closed lines)."""
    check_bindable(host, port)
    check_options(options)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if WEB_DIR is not None:
        llm = f"answers from {options.llm.model}" if options.llm else "no --llm-url: it speaks what you type"
        logging.getLogger("voxgate").info("voice-chat demo: http://%s:%d/ (%s)", host, port, llm)
    server = build_server(options, host, port, log_level)
    server.run()
    return server.exit_code
