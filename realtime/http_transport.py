"""uvicorn's HTTP/1.1 protocol (h11) with the guards it lacks: a deadline for each request's headers (silent and
slow-loris connections), a body that may not stall, a cap on open connections, one way to frame a body, the API's
JSON error where uvicorn answered in plain text, and a lingering close, so that a client still sending the body of
a request that was answered early (413, 401, 503) reads that answer instead of a reset."""
from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE  # as uvicorn sizes its own connection
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from realtime.errors import HTTPFailure


def _closing_response(failure: HTTPFailure, reason: str) -> bytes:
    """A whole HTTP/1.1 response written before the app sees the request: the API's JSON error, then the close."""
    body = json.dumps(failure.body()).encode()
    extra = "".join(f"{name}: {value}\r\n" for name, value in failure.headers().items())
    head = (f"HTTP/1.1 {failure.status} {reason}\r\ncontent-type: application/json\r\n{extra}"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


_OVER_CAPACITY = _closing_response(HTTPFailure(503, "overloaded", "too many open connections; try again later"),
                                   "Service Unavailable")
_MALFORMED = _closing_response(HTTPFailure(400, "invalid_message", "malformed HTTP/1.1 request: its request line, a "
                                                                   "header or its Content-Length cannot be parsed"),
                               "Bad Request")
_VERSION_NOT_SERVED = _closing_response(HTTPFailure(505, "invalid_message", "this server speaks HTTP/1.1 (and 1.0): "
                                                                          "HTTP/2 with prior knowledge, or another "
                                                                          "major version, is not served"),
                                       "HTTP Version Not Supported")
_FRAMED_TWICE = _closing_response(HTTPFailure(400, "invalid_message", "the request gives both Content-Length and "
                                                                      "Transfer-Encoding: frame its body one way"),
                                  "Bad Request")


# A chunked body's chunks: h11 parses each in Python (~25 us), so a body of one-byte chunks cost the event loop ~4 us
# a byte sent (a hostile try: 1.5 MB of them held every other stream's audio for 3.5 s). A body may have FREE_CHUNKS
# chunks, and one more for each BYTES_PER_CHUNK of its size.
FREE_CHUNKS = 64
BYTES_PER_CHUNK = 1024
_CHUNKS_TOO_SMALL = _closing_response(HTTPFailure(400, "invalid_message", f"a chunked body's chunks must average at "
                                                                          f"least {BYTES_PER_CHUNK} bytes"),
                                      "Bad Request")


class _GuardedConnection(h11.Connection):
    """h11's server side with four rules more.

    A request of another major version than 1 is refused (505): h11 parsed HTTP/2's connection preface as a request
    ("PRI *", then "SM" as a second one), and a client that tries HTTP/2 with prior knowledge got two answers.
    A request with both Transfer-Encoding and Content-Length "ought to be handled as an error" (RFC 9112, 6.3): h11
    read the chunked body and ignored the length, and a proxy in front that read the length instead would take the
    rest for another request (request smuggling). A chunked body of chunks too small to be worth their parsing is
    refused (FREE_CHUNKS). An answer sent before its request's body has ended (413 from the Content-Length, 401, 404)
    says `Connection: close`: the rest of the body is then read under the linger's bounds (a kept-alive connection
    read it, without end, for as long as the client sent it)."""

    def __init__(self, max_incomplete_event_size: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size)
        self.refusal: bytes | None = None  # the response a request refused here gets
        self._chunks = 0  # of the request's body
        self._body_bytes = 0

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request):
            if not event.http_version.startswith(b"1."):  # h11 takes any x.y: HTTP/2's preface was served as a
                self.refusal = _VERSION_NOT_SERVED  # request, "PRI *" (404), then its "SM" line as another (400)
                raise h11.RemoteProtocolError(f"HTTP/{event.http_version.decode()} is not served")
            names = {name for name, _ in event.headers}  # h11 gives them lower-cased
            if b"content-length" in names and b"transfer-encoding" in names:
                self.refusal = _FRAMED_TWICE
                raise h11.RemoteProtocolError("Content-Length and Transfer-Encoding together")
            self._chunks = self._body_bytes = 0
        elif isinstance(event, h11.Data):
            self._body_bytes += len(event.data)
            self._chunks += event.chunk_start
            if self._chunks > FREE_CHUNKS + self._body_bytes // BYTES_PER_CHUNK:
                self.refusal = _CHUNKS_TOO_SMALL
                raise h11.RemoteProtocolError("a chunked body of chunks too small")
        return event

    def send(self, event: Any) -> bytes | None:
        if isinstance(event, h11.Response) and self.their_state is h11.SEND_BODY:
            headers = [(name, value) for name, value in event.headers if name != b"connection"]
            event = h11.Response(status_code=event.status_code, reason=event.reason, http_version=event.http_version,
                                 headers=[*headers, (b"connection", b"close")])
        return super().send(event)


# a request answered before its body was read (413 from the Content-Length, 401, 503): the rest of its body is read
# and dropped for at most this long and this much, then the socket closes. Closing a socket with unread bytes sends
# a reset, and a client that sends its whole body before it reads (urllib, curl) saw a broken pipe, not the answer.
LINGER_S = 10.0
LINGER_BYTES = 64 * 1024 * 1024
SHUTDOWN_FLUSH_S = 2.0  # what a response still being sent when the server stops gets to finish
# a response its client stops taking (the socket's buffers full) must be taken at MIN_BODY_RATE over each
# WRITE_STALL_S, or it is dropped with its connection: an unread body is not held for ever (a whole one sits in a
# temporary file, up to hundreds of MB), and a client reading as it plays (slower than the audio is made) keeps it
WRITE_STALL_S = 20.0
TCP_INFO_BYTES_ACKED = slice(120, 128)  # Linux's struct tcp_info: tcpi_bytes_acked, a little-endian u64
GONE_EXTENSION = "voxgate.client_gone"  # scope extension: a call that says whether the request's client has gone


def bytes_acked(transport: asyncio.BaseTransport) -> int | None:
    """How much of what this socket sent its peer has acknowledged (Linux's TCP_INFO); None where that is unknown."""
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return None
    return int.from_bytes(info[TCP_INFO_BYTES_ACKED], "little") if len(info) >= TCP_INFO_BYTES_ACKED.stop else None


class _LingeringTransport:
    """The socket's transport as uvicorn and the app see it: its close() goes through the protocol, which may read
    the rest of an answered request's body first; while it does, the transport counts as closing."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedH11Protocol) -> None:
        self.raw = transport
        self._protocol = protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)

    def close(self) -> None:
        self._protocol.close_after_body()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self.raw.is_closing()


# seconds a request body may go without a byte while the server waits to read it; a stalled body is closed (a
# hostile try held every connection of the server with request headers, one body byte and then nothing)
BODY_STALL_S = 30.0
# a body still coming BODY_GRACE_S after it began must have kept up MIN_BODY_RATE on average: one trickled a byte at
# a time never stalls, and held its connection (the cap's room) for as long as it liked (a hostile try)
BODY_GRACE_S = 10.0
MIN_BODY_RATE = 1_000  # bytes a second


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the guards it lacks. A request's headers (a WebSocket handshake's included) must
    be complete within `handshake_timeout_s` of the connection, or of the first byte of a later request on a kept-
    alive one; a request body must not stop for BODY_STALL_S while the server waits for it, nor average less than
    MIN_BODY_RATE once BODY_GRACE_S have passed (a slow small body is fine, a stopped or trickled one is not);
    otherwise the connection is closed, so idle and one-byte-a-second sockets cannot pile up.
    Past `max_connections` open connections (HTTP and WebSocket) the oldest connection the server owes nothing is
    answered 503 and closed to make room (one that has sent no complete request yet, a kept-alive one between
    requests, or one answered already whose body is only being drained): no answer is lost, and sockets that never
    send a request,
    or send refused ones, cannot lock everyone out for a handshake timeout (or a linger) at a time. (Finding it
    walks the open connections: a cost paid only at the cap.)
    When every connection is busy, the new one gets the 503 and is closed. A connection closed after an answer while
    its client may still be sending (a body, or a request the 503 refused) lingers (LINGER_S, LINGER_BYTES)."""

    def __init__(self, config: uvicorn.Config, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, handshake_timeout_s: float,
                 max_connections: int) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.conn = _GuardedConnection(config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE)
        self.handshake_timeout_s = handshake_timeout_s
        self.max_connections = max_connections
        self._headers_deadline: asyncio.TimerHandle | None = None
        self._body_deadline: asyncio.TimerHandle | None = None
        self._body_since = 0.0  # when the body being read began
        self._body_cycle: Any = None  # the request it belongs to (uvicorn's cycle: a new one for each request)
        self._body_bytes = 0  # bytes received since then (from the chunk it began in)
        self._upgraded = False  # the socket belongs to the WebSocket protocol now
        self.lingering = False  # answered and closing: the rest of the request's body is read and dropped
        self._linger_parsed = True  # lingering, the body ends where h11 says (else: until the client closes)
        self._lingered_bytes = 0
        self._stopping = False
        self._linger_deadline: asyncio.TimerHandle | None = None
        self._idle_since = 0.0  # since when it is owed nothing (`_make_room` closes the oldest first)
        self._write_deadline: asyncio.TimerHandle | None = None  # set while the client takes none of a response
        self._acked: int | None = None  # bytes the client had acknowledged when the deadline was set (None: unknown)
        self._announced: Any = None  # the last request cycle given GONE_EXTENSION

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]
        self._idle_since = self.loop.time()
        if len(self.connections) > self.max_connections and not self._make_room():
            self.refuse_for_room()
            return
        self._arm()

    def _make_room(self) -> bool:
        """Close the connection that has been without a request in progress the longest; False if none is."""
        owed_nothing = [c for c in self.connections
                        if isinstance(c, GuardedH11Protocol) and c is not self and c.owed_nothing()]
        if not owed_nothing:
            return False
        min(owed_nothing, key=lambda c: c._idle_since).refuse_for_room()
        return True

    def refuse_for_room(self) -> None:
        """Closed for want of room: the 503 (with Retry-After), then the close after what the client still sends is
        drained (LINGER_S, LINGER_BYTES), so that a client whose request was on its way reads the answer instead of
        a reset (a hostile try: 22 of 24 such POSTs got a broken pipe). One already answered just closes."""
        if self.lingering or self._stopping:
            self.transport.raw.close()
            return
        self.transport.raw.write(_OVER_CAPACITY)
        self.transport.raw.write_eof()
        self._linger(parsed=False)

    def owed_nothing(self) -> bool:
        """Closing it loses nothing: no request begun (its headers incomplete), the last one answered and kept alive,
        or answered and lingering only to drain its body."""
        if self._upgraded or self.transport.raw.is_closing():
            return False
        return self.lingering or (self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            self._drop_body(data)
            return
        if self.transport.is_closing():  # refused or timed out: nothing more is read
            return
        if self.conn.their_state is h11.IDLE:
            self._arm()
        self._body_bytes += len(data)
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()
        self._watch_body()

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (or `_GuardedConnection` refuses) gets the API's JSON error (uvicorn sends plain
        text), unless its answer has begun already; then the close, after what the client still sends is drained
        (LINGER_S, LINGER_BYTES)."""
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self.transport.write(self.conn.refusal or _MALFORMED)
        # the app is still answering this request (refused inside its body: a chunked body of tiny chunks): closed at
        # once as before, since the app may still write
        answering = self.cycle is not None and not self.cycle.response_complete
        if self._stopping or self.transport.raw.is_closing() or answering:
            self.transport.raw.close()
            return
        self.transport.raw.write_eof()  # the answer ends here: the client reads it to the end and closes
        self._linger(parsed=False)  # closed with the rest of a long header unread, the socket sent a reset instead

    def on_response_complete(self) -> None:
        """A pipelined request, already read, starts here rather than in `data_received`: its body is watched too."""
        super().on_response_complete()
        self._idle_since = self.loop.time()
        self._watch_body()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._disarm()  # the WebSocket protocol takes the socket over: this one hears nothing more
        self._upgraded = True
        self._stop_watching_body()
        self.transport = self.transport.raw  # the WebSocket protocol closes its socket itself
        super().handle_websocket_upgrade(event)

    def handle_events(self) -> None:
        """uvicorn's, and a request's scope gets GONE_EXTENSION (before its application runs: the task starts on a
        later turn), so that a response can stop once its client has gone without asking `receive`, which resumes
        reading: a pipelined client's bytes then pile up in h11's buffer (a review)."""
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and cycle is not self._announced:
            cycle.scope.setdefault("extensions", {})[GONE_EXTENSION] = lambda: cycle.disconnected
            self._announced = cycle

    def pause_writing(self) -> None:
        """The client takes too little of the response: WRITE_STALL_S from now it is dropped, unless it has taken
        MIN_BODY_RATE's worth by then (checked again each WRITE_STALL_S while writing stays paused)."""
        super().pause_writing()
        if self._write_deadline is None:
            self._arm_write_deadline()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_write_deadline()

    def _arm_write_deadline(self) -> None:
        self._acked = bytes_acked(self.transport)
        self._write_deadline = self.loop.call_later(WRITE_STALL_S, self._write_stalled)

    def _write_stalled(self) -> None:
        """Writing has stayed paused WRITE_STALL_S: a client that took at least MIN_BODY_RATE meanwhile reads (slowly,
        or as it plays: its socket's buffers are megabytes, and writing resumes only once a third of them is free),
        and keeps the response; one that took less is dropped (unknown, without TCP_INFO: kept)."""
        self._write_deadline = None
        acked = bytes_acked(self.transport)
        if acked is None or self._acked is None or acked - self._acked >= MIN_BODY_RATE * WRITE_STALL_S:
            self._arm_write_deadline()
            return
        self._drop_unsent()

    def _stop_write_deadline(self) -> None:
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._stop_watching_body()
        self._stop_write_deadline()
        if self._linger_deadline is not None:
            self._linger_deadline.cancel()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """The server stops (after its sessions and speech requests had their grace, `app.drain`): no connection
        lingers, and a response still being sent gets SHUTDOWN_FLUSH_S more, then its connection is dropped. A
        client that stopped reading held the shutdown until uvicorn cancelled its response, logged as a crash."""
        self._stopping = True
        if self.lingering:
            self.transport.raw.close()
            return
        super().shutdown()
        if self.cycle is not None and not self.cycle.response_complete:
            self.loop.call_later(SHUTDOWN_FLUSH_S, self._drop_unsent)

    def _drop_unsent(self) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.raw.abort()  # the response's sends return at once from here on (uvicorn's cycle)

    def close_after_body(self) -> None:
        """Closes the socket, or, when the request was answered while its body is still coming, first reads that
        body to its end (or for LINGER_S, or LINGER_BYTES), dropping it."""
        if self.lingering:
            return
        answered = self.conn.our_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)
        gone = self._stopping or self.transport.raw.is_closing()  # the server stops, or the socket is closed already
        if gone or not (answered and self.conn.their_state is h11.SEND_BODY and not self._upgraded):
            self.transport.raw.close()
            return
        self._linger(parsed=True)

    def _linger(self, parsed: bool) -> None:
        """Answered: read and drop what still comes, then close, so that the client reads the answer (a socket closed
        with unread bytes sends a reset, which discards it). `parsed`: the request's body ends where h11 says;
        otherwise (a request it could not parse) until the client closes, LINGER_S or LINGER_BYTES."""
        self.lingering, self._linger_parsed = True, parsed
        self._idle_since = self.loop.time()
        self._disarm()
        self._stop_watching_body()
        self._linger_deadline = self.loop.call_later(LINGER_S, self.transport.raw.close)
        self.transport.raw.resume_reading()  # paused while the app held more body than it read

    def _drop_body(self, data: bytes) -> None:
        self._lingered_bytes += len(data)
        if self._lingered_bytes > LINGER_BYTES or (self._linger_parsed and self._body_ended(data)):
            self.transport.raw.close()

    def _body_ended(self, data: bytes) -> bool:
        """Gives `data` to h11: whether the request's body has ended with it (or cannot be read on)."""
        try:
            self.conn.receive_data(data)
            while (event := self.conn.next_event()) is not h11.NEED_DATA:
                if not isinstance(event, h11.Data):
                    return True
        except h11.RemoteProtocolError:
            return True
        return False

    def _watch_body(self) -> None:
        """After each piece of a request: while its body is still to come, BODY_STALL_S from now; closed at once
        when it has come too slowly (MIN_BODY_RATE after BODY_GRACE_S)."""
        self._stop_watching_body()
        # an upgrade's request never reaches its end in h11 (its state stays SEND_BODY): the WebSocket protocol owns
        # the socket, and a timer here closed every session BODY_STALL_S after its handshake
        if self.conn.their_state is not h11.SEND_BODY or self._upgraded or self.transport.is_closing():
            self._body_bytes = 0  # the next chunk, the next request's head included, counts
            return
        now = self.loop.time()
        if self.flow.read_paused:  # the server's own pause is not the client's pace
            self._body_since, self._body_bytes = now, 0
        elif self._body_cycle is not self.cycle:  # a new request's body (kept alive or pipelined behind the last)
            self._body_since, self._body_cycle = now, self.cycle
        elif now - self._body_since > BODY_GRACE_S and self._body_bytes < MIN_BODY_RATE * (now - self._body_since):
            self._body_stalled()
            return
        self._body_deadline = self.loop.call_later(BODY_STALL_S, self._body_stalled)

    def _stop_watching_body(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _body_stalled(self) -> None:
        self._body_deadline = None
        if self.flow.read_paused:  # the server is not reading (its buffer is full): the client is not to blame
            self._watch_body()
            return
        self.transport.raw.close()  # no linger; the application sees the client gone (ClientDisconnect: counted 499)

    def _arm(self) -> None:
        if self._headers_deadline is None:
            self._headers_deadline = self.loop.call_later(self.handshake_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._headers_deadline is not None:
            self._headers_deadline.cancel()
            self._headers_deadline = None

    def _headers_late(self) -> None:
        self._headers_deadline = None
        self.transport.close()


