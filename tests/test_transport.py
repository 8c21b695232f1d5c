"""The transport against a hostile client, on a real server: connections that never finish their request headers are
closed after the handshake timeout, open connections are capped, API keys come from the environment or a file and
never reach a log, and `voxgate serve` fails fast and clearly."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

from realtime.gateway import GatewayOptions, Limits
from realtime import http_transport
from realtime.server import SOCKET_LOG, build_server, redact
from tests.gateway_server import running_server, serve_in_thread

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 1.0  # the servers' handshake timeout here
MARGIN_S = 1.0
KEY = "transport-key-7f3a9c"
SLOW_REQUEST = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: 1\r\n" * 1000  # never ends its headers


@pytest.fixture(scope="module")
def server():
    # every request is held to the runaway guard's own length (10 frames a text token), EOS banned: the tiny random
    # model sometimes samples EOS early, and a streamed answer that ended after 0.7 s failed the test of a response
    # outliving the handshake timeout (two rehearsals of ~990 tests)
    with running_server(Limits(handshake_timeout_s=TIMEOUT_S, max_sessions=2, max_connections=5,
                               api_keys=(KEY,)), synthetic_frames_per_token=10.0) as running:
        yield running


def raw_socket(server) -> socket.socket:
    host, port = server.http.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def seconds_until_closed(sock: socket.socket, drip: bytes = b"", limit_s: float = TIMEOUT_S + 3) -> float:
    """How long the server keeps `sock` open while the client sends `drip` one byte every 0.2 s (faster than the
    timeout, so that a deadline pushed back by each byte would never fire)."""
    started = time.monotonic()
    sock.settimeout(0.2)
    for index in range(10 ** 6):
        if time.monotonic() - started > limit_s:
            raise AssertionError(f"the server kept the connection open for {limit_s} s")
        try:
            if index < len(drip):
                sock.send(drip[index:index + 1])
            if sock.recv(4096) == b"":
                return time.monotonic() - started
        except TimeoutError:
            continue
        except OSError:  # reset: closed too
            return time.monotonic() - started
    raise AssertionError("unreachable")


def test_a_silent_connection_is_closed_after_the_handshake_timeout(server):
    with raw_socket(server) as sock:
        assert TIMEOUT_S - 0.1 <= seconds_until_closed(sock) <= TIMEOUT_S + MARGIN_S


def test_a_request_sent_a_byte_at_a_time_is_closed_after_the_handshake_timeout(server):
    with raw_socket(server) as sock:
        assert TIMEOUT_S - 0.1 <= seconds_until_closed(sock, SLOW_REQUEST) <= TIMEOUT_S + MARGIN_S


def test_a_stopped_request_body_is_closed_and_a_slow_one_is_not(server, monkeypatch):
    """Headers and one byte of a body, then nothing: such connections held every connection of a server (each new
    request, /ready too, got 503) for as long as the client liked. A body that stops for BODY_STALL_S is closed; one
    that keeps coming, however slowly, is read whole."""
    monkeypatch.setattr(http_transport, "BODY_STALL_S", 1.0)
    head = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
            b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    with raw_socket(server) as sock:
        sock.sendall(head)
        assert 0.9 <= seconds_until_closed(sock) <= 1.0 + MARGIN_S
    body = json.dumps({"input": "Hi.", "response_format": "pcm", "stream": False}).encode()
    with raw_socket(server) as sock:  # the whole body, a byte every 0.2 s: 5x the stall bound in all
        sock.sendall(head.replace(b"Content-Length: 100", b"Content-Length: %d" % len(body))[:-1])
        for index in range(len(body)):
            sock.sendall(body[index:index + 1])
            time.sleep(0.2 if index < 25 else 0)
        sock.settimeout(60)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")


def test_a_trickled_request_body_is_closed_and_a_steady_one_is_not(server, monkeypatch):
    """A body that never stops but comes a few bytes at a time held its connection (the cap's room) for as long as
    its client liked: past BODY_GRACE_S it must have averaged MIN_BODY_RATE. One that keeps the rate is read whole."""
    monkeypatch.setattr(http_transport, "BODY_GRACE_S", 1.0)
    monkeypatch.setattr(http_transport, "MIN_BODY_RATE", 1_000)
    body = json.dumps({"input": "Hi.", "response_format": "pcm", "stream": False}).encode() + b" " * 6_000
    head = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
            b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
    with raw_socket(server) as sock:  # 100 bytes a second, never stopping
        sock.sendall(head)
        started, closed = time.monotonic(), False
        sock.settimeout(0.1)
        for index in range(0, len(body), 10):
            try:
                sock.send(body[index:index + 10])
                closed = sock.recv(4096) == b""
            except TimeoutError:
                continue
            except OSError:
                closed = True
            if closed or time.monotonic() - started > 1.0 + 2 * MARGIN_S:
                break
        assert closed and 0.9 <= time.monotonic() - started <= 1.0 + 2 * MARGIN_S
    with raw_socket(server) as sock:  # 4,000 bytes a second for 2 s: above the rate all along
        sock.sendall(head)
        for index in range(0, len(body), 400):
            sock.sendall(body[index:index + 400])
            time.sleep(0.1)
        sock.settimeout(60)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("connection", [b"Connection: close\r\n", b""], ids=["close", "keep-alive"])
def test_an_answered_request_whose_body_never_ends_lingers_no_longer_than_the_bound(server, monkeypatch, connection):
    """A request answered before its body (413 from its Content-Length) keeps the connection while the rest of
    the body comes, so that the client reads the answer; a body that keeps coming, a byte every 0.2 s, holds it no
    longer than LINGER_S. Kept alive, the connection was read for as long as the body came (a hostile try: 359 MiB
    in 60 s): its answer says `Connection: close`, and the same bound holds."""
    monkeypatch.setattr(http_transport, "LINGER_S", 1.0)
    head = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
            b"\r\nContent-Type: application/json\r\n" + connection + b"Content-Length: 100000000\r\n\r\n")
    with raw_socket(server) as sock:
        sock.sendall(head)
        answer = b""
        while b'"text_too_long"' not in answer:
            answer += sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 413 ")
        assert 0.9 <= seconds_until_closed(sock, drip=b"a" * 100) <= 1.0 + MARGIN_S


def test_a_pipelined_request_whose_body_stops_is_closed_too(server, monkeypatch):
    """A request sent behind another on the same write starts when the first has been answered, not when bytes
    arrive: its stopped body was not watched, and held the connection for good."""
    monkeypatch.setattr(http_transport, "BODY_STALL_S", 1.0)
    first = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    stalled = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
               b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    with raw_socket(server) as sock:
        sock.sendall(first + stalled)
        response = b""
        while b'{"status":"ok"}' not in response:
            response += sock.recv(4096)
        assert 0.9 <= seconds_until_closed(sock) <= 1.0 + MARGIN_S


def test_a_websocket_session_outlives_the_body_stall_bound(server, monkeypatch):
    """An upgrade's request stays in h11's body state: the body guard closed every session BODY_STALL_S after its
    handshake, with no close frame (a review found it before any client did)."""
    monkeypatch.setattr(http_transport, "BODY_STALL_S", 0.5)

    async def go():
        async with connect(server.ws, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            assert json.loads(await ws.recv())["type"] == "session.started"
            for ping in range(8):  # 2 s: four times the bound
                await asyncio.sleep(0.25)
                await ws.send(json.dumps({"type": "ping", "id": ping}))
                pong = json.loads(await asyncio.wait_for(ws.recv(), 10))
                assert (pong["type"], pong["id"]) == ("pong", ping)

    asyncio.run(go())


def test_the_next_request_on_a_kept_alive_connection_has_the_same_deadline(server):
    """uvicorn's keep-alive timer stops at the first byte of the next request: without the deadline, a trickle
    would hold the connection for ever."""
    with raw_socket(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        response = b""
        while b'{"status":"ok"}' not in response:
            response += sock.recv(4096)
        assert response.startswith(b"HTTP/1.1 200")
        assert seconds_until_closed(sock, SLOW_REQUEST) <= TIMEOUT_S + MARGIN_S


def test_requests_within_the_deadline_and_streamed_responses_are_not_cut(server):
    with raw_socket(server) as sock:  # headers sent in pieces, complete within the deadline
        for piece in (b"GET /health HT", b"TP/1.1\r\nHost: x\r\n", b"\r\n"):
            sock.sendall(piece)
            time.sleep(TIMEOUT_S / 4)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(TIMEOUT_S * 1.5)  # an idle kept-alive connection is uvicorn's keep-alive timeout's (5 s)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    started = time.monotonic()
    # long enough that its synthesis outlasts the handshake timeout on a fast machine too ("One, two." took 1.24 s on
    # an idle 2-core box: just under what the check below needs)
    status, _, pcm = server.post("/v1/audio/speech", {"input": "One, two, three, four, five, six.",
                                                      "response_format": "pcm"}, KEY)
    took = time.monotonic() - started
    assert status == 200, pcm[:300]  # first, so that a refusal says so rather than reading as a short stream
    assert len(pcm) >= 2 * 24000 * 2  # whole: 2 s at least
    assert took > TIMEOUT_S + 0.3, f"{len(pcm) / 48000} s of audio in {took:.2f} s"  # it outlived the timeout


def unread_whole_body(server) -> tuple[socket.socket, int]:
    """A socket that asked for a long whole body (~7 MB of PCM) and has read only its head, with a receive buffer
    so small that the server's writing soon stops; and the body's length."""
    body = json.dumps({"input": "This is a sentence of several words. " * 6, "response_format": "pcm",
                       "stream": False, "speed": 0.25}).encode()
    host, port = server.http.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(120)
    sock.connect((host, int(port)))
    sock.sendall(f"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: "
                 f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    head = b""
    while b"\r\n\r\n" not in head:  # the body is made whole first: this waits for the synthesis
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock, int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))


def read_to_the_end(sock: socket.socket) -> int:
    received = 0
    try:
        while data := sock.recv(1 << 20):
            received += len(data)
    except ConnectionResetError:
        pass
    return received


def test_a_whole_body_its_client_takes_none_of_is_dropped_with_its_connection(server, monkeypatch):
    """A hostile try's find: a `"stream": false` body that its client never read stayed in its temporary file (18 MB
    in that try; hundreds of MB for a long text at speed 0.25) for as long as the client held the connection, and
    enough such clients fill the disk. Past WRITE_STALL_S with less than MIN_BODY_RATE of it taken the connection
    is dropped (and the file with it); the server goes on serving."""
    monkeypatch.setattr(http_transport, "WRITE_STALL_S", 1.0)
    sock, length = unread_whole_body(server)
    with sock:
        time.sleep(1.0 + 2 * MARGIN_S)  # the client takes nothing
        received = read_to_the_end(sock)
    assert received < length, f"all {length} bytes were still held for the client"
    assert server.get("/health")[0] == 200


def test_a_client_reading_slowly_keeps_its_whole_body(server, monkeypatch):
    """A review's find: the deadline ran while writing stayed paused, and a client reading as it plays (real-time
    PCM, 48 KB/s) keeps it paused for longer than WRITE_STALL_S (writing resumes once a third of megabytes of
    socket buffer is free): it got 3.6 MB of 64 and then the end. A client that takes MIN_BODY_RATE or more over
    each WRITE_STALL_S keeps its response, and gets all of it."""
    monkeypatch.setattr(http_transport, "WRITE_STALL_S", 1.0)
    sock, length = unread_whole_body(server)
    with sock:
        received = 0
        for _ in range(40):  # 4 s at ~40 KB/s, far below what the server would send
            received += len(sock.recv(4096))
            time.sleep(0.1)
        received += read_to_the_end(sock)
    assert received == length


def test_a_websocket_session_outlives_the_handshake_timeout(server):
    async def go():
        async with connect(server.ws + f"?token={KEY}&encoding=pcm_s16le", max_size=None) as ws:
            assert json.loads(await ws.recv())["type"] == "session.started"
            await asyncio.sleep(TIMEOUT_S * 1.5)
            await ws.send(json.dumps({"type": "text.append", "context_id": "c", "text": "Hi."}))
            await ws.send(json.dumps({"type": "context.end", "context_id": "c"}))
            while True:
                message = await asyncio.wait_for(ws.recv(), 60)
                if isinstance(message, str) and json.loads(message)["type"] == "context.done":
                    return
    asyncio.run(go())


def test_a_request_sent_at_once_past_the_cap_reads_its_503_not_a_reset(server):
    """A hostile try: clients that connect and send a whole POST at once, past the cap with every connection busy,
    mostly got a broken pipe or a reset: the 503 was written and the socket closed with their request unread. The
    refused connection drains what the client sends, so it reads the 503 (with Retry-After) and a clean close."""
    head = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
            b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    busy = [raw_socket(server) for _ in range(5)]
    try:
        for sock in busy:  # five requests in progress: nothing to evict
            sock.sendall(head)
        time.sleep(0.1)
        body = json.dumps({"input": "Hello there.", "pad": "x" * 50_000}).encode()
        for _ in range(3):
            late = raw_socket(server)
            late.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            answer = b""
            while chunk := late.recv(65536):
                answer += chunk
            late.close()
            assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in answer.lower(), answer[:200]
    finally:
        for sock in busy:
            sock.close()
    time.sleep(0.2)
    assert server.get("/health")[0] == 200


def test_connections_past_the_cap_close_the_oldest_silent_one_or_get_a_503(server):
    """The cap is 5. Five sockets that never send a request: a sixth closes the oldest of them and is served, so
    silent sockets cannot lock a client out. Sockets inside a request (a body still to come) are never closed for
    room: with five of them the sixth is answered 503 at once; closing them frees room."""
    head = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
            b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    socks = [raw_socket(server) for _ in range(5)]
    try:
        time.sleep(0.1)
        assert server.get("/health")[0] == 200
        readable, _, _ = select.select(socks, [], [], TIMEOUT_S / 2)
        assert readable == [socks[0]]
        evicted = b""
        while chunk := socks[0].recv(4096):
            evicted += chunk
        assert evicted.startswith(b"HTTP/1.1 503")  # told why, then closed (a request on its way reads it, not a reset)
        socks[0].close()
        for sock in socks[1:]:  # four requests in progress, and a fifth
            sock.sendall(head)
        socks[0] = raw_socket(server)
        socks[0].sendall(head)
        time.sleep(0.1)
        late = raw_socket(server)
        socks.append(late)
        readable, _, _ = select.select(socks, [], [], TIMEOUT_S / 2)
        assert readable == [late]
        refused = b""
        while chunk := late.recv(4096):
            refused += chunk
        head, _, body = refused.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"application/json" in head
        assert b"\r\nretry-after: 1\r\n" in head.lower()  # when to try again, as HTTP clients and OpenAI's SDKs read it
        assert json.loads(body)["error"]["code"] == "overloaded"  # the API's JSON error, as every refusal
    finally:
        for sock in socks:
            sock.close()
    time.sleep(0.2)
    assert server.get("/health")[0] == 200


@pytest.mark.parametrize("size", [200_000, 3_000_000])
def test_a_header_too_long_to_parse_gets_its_400_not_a_reset(server, size):
    """The server stops parsing past its header bound and answers; the rest of the header, still coming after the
    answer, is read and dropped until the client closes, so the client reads the answer (closed at once, the socket
    answered those bytes with a reset, and the client saw no answer at all)."""
    with raw_socket(server) as sock:
        sock.settimeout(30)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * size)
        time.sleep(0.3)  # answered by now
        sock.sendall(b"a" * size + b"\r\n\r\n")
        time.sleep(0.3)
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
            if b'"invalid_message"' in answer:
                break
        assert answer.startswith(b"HTTP/1.1 400 ") and b'"invalid_message"' in answer


@pytest.mark.parametrize("path", ["/v1/audio/speech", "/v1/lexicons", "/v1/audio/voices"])
@pytest.mark.parametrize("encoding", ["gzip", "br", "Deflate"])
def test_a_compressed_body_is_refused_by_name(server, path, encoding):
    """A body sent with a Content-Encoding was read as it is (a gzip body parsed as JSON); now 415, the API's JSON
    error naming the encoding."""
    request = urllib.request.Request(server.http + path, data=b'{"input": "Hi."}', method="POST", headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json", "Content-Encoding": encoding})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    error = json.loads(refused.value.read())["error"]
    assert refused.value.code == 415 and error["code"] == "invalid_message" and encoding.lower() in error["message"]


def test_refused_requests_whose_bodies_linger_do_not_hold_the_cap(server):
    """Requests with no key and a body announced but never sent are answered 401 at once, then drained (LINGER_S):
    five of them filled the cap of 5 and every client got 503 for as long as they were renewed. Answered, they are
    owed nothing: a new client closes the oldest of them and is served."""
    refused = b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n"
    socks = [raw_socket(server) for _ in range(5)]
    try:
        for sock in socks:
            sock.sendall(refused)
            answer = b""
            while b'"unauthorized"' not in answer:
                answer += sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 401")
        assert server.get("/health")[0] == 200
        assert server.get("/v1/voices", KEY)[0] == 200
    finally:
        for sock in socks:
            sock.close()


def test_build_server_exits_non_zero_when_the_gateway_fails_for_good():
    server = build_server(GatewayOptions(), port=0, log_level="warning")
    thread, _ = serve_in_thread(server)
    server.gateway.on_fatal("the engine died")
    thread.join(timeout=30)
    assert not thread.is_alive() and server.exit_code == 1


@pytest.mark.parametrize("line", [
    '127.0.0.1:5 - "GET /v1/voices?token=SECRET HTTP/1.1" 200',
    '"WebSocket /v1/tts/stream?voice=a&token=SECRET&encoding=pcm_s16le" [accepted]',
    "/x?api_key=SECRET", "/x?key=SECRET#f", "/x?%74oken=SECRET", "/x?a=1;access_token=SECRET",
    "/x?password=SECRET", "/x?Authorization=SECRET", "/x?auth=SECRET", "/x?bearer=SECRET", "/x;client_secret=SECRET",
    '"GET /x?token=a;SECRET\'SECRET\"SECRET HTTP/1.1" 200', "/x?token=SECRET;a&voice=b",  # a key may hold ; and quotes
    "/x?token=SECRET;x=SECRET", "/x?token=SECRET#SECRET&voice=b", "/x?token=a\"x=SECRET",  # and = or # after them
])
def test_redact_removes_every_secret_query_value(line):
    assert "SECRET" not in redact(line) and "[redacted]" in redact(line)
    assert redact("/x?voice=vivian&encoding=opus") == "/x?voice=vivian&encoding=opus"


def test_a_sockets_log_lines_are_redacted_too(caplog):
    """At debug level a session logs its opening; its warnings always: the key in its path never shows."""
    build_server(GatewayOptions(), port=0, log_level="debug")
    with caplog.at_level(logging.DEBUG):
        SOCKET_LOG.info('127.0.0.1:5 - "WebSocket %s" [accepted]', "/v1/tts/stream?token=SECRET")
    assert "token=[redacted]" in caplog.text and "SECRET" not in caplog.text
    build_server(GatewayOptions(), port=0, log_level="info")
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        SOCKET_LOG.info("connection open")
        SOCKET_LOG.warning("a warning of %s", "/v1/tts/stream?token=SECRET")
    assert caplog.messages == ["a warning of /v1/tts/stream?token=[redacted]"]


@pytest.mark.parametrize("unit", ["?", "?a", "&", ";a", "?=", "?a?token", "?token=;'", "=;\"", ";a=", "&token=;"])
def test_redact_takes_linear_time(unit):
    """Every logged request line is redacted on the event loop: a query of 40,000 separators takes a blink (a name
    pattern that ran on over later `?` took seconds for 15,000, and every socket waited)."""
    line = "GET /health" + unit * (40_000 // len(unit))
    started = time.perf_counter()
    redact(line)
    assert time.perf_counter() - started < 0.5
    assert redact("/x?a?token=SECRET") == "/x?a?token=[redacted]"


def voxgate(*args: str, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "realtime.cli", *map(str, args)], cwd=ROOT,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **popen)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def http_status(url: str, token: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as failure:
        return failure.code


@pytest.fixture(scope="module")
def served_log(tmp_path_factory) -> dict:
    """A `voxgate serve` process with keys from $VOXGATE_API_KEYS and --api-key-file (none on its command line),
    used over HTTP and WebSocket with ?token=KEY; what it logged at INFO once stopped."""
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text("# the file's key\n\n  file-key-51d0e2  \n")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = voxgate("serve", "--port", port, "--api-key-file", key_file, "--handshake-timeout", TIMEOUT_S,
                     env={"VOXGATE_API_KEYS": f"env-key-a81c44, {KEY}"})
    results: dict = {}
    try:
        deadline = time.monotonic() + 120
        while http_status_or_none(base + "/ready") != 200:
            assert time.monotonic() < deadline and server.poll() is None, "the server did not become ready"
            time.sleep(0.2)
        for key in ("env-key-a81c44", KEY, "file-key-51d0e2", None, "wrong-key-0c9b7d"):
            results[key] = http_status(base + "/v1/voices", key)
        results["query"] = http_status(base + f"/v1/voices?token={KEY}")
        results["long"] = http_status(base + "/v1/voices?q=" + "a" * 9000, KEY)
        results["events"] = asyncio.run(speak_with_query_token(port))
    finally:
        server.send_signal(signal.SIGINT)
        results["log"] = server.communicate(timeout=60)[0]
    return results


def http_status_or_none(url: str) -> int | None:
    try:
        return http_status(url)
    except OSError:
        return None


TEXT = "Zebulon quartzite marmalade"


async def speak_with_query_token(port: int) -> list[str]:
    async with connect(f"ws://127.0.0.1:{port}/v1/tts/stream?token={KEY}&encoding=pcm_s16le", max_size=None) as ws:
        types = [json.loads(await ws.recv())["type"]]
        await ws.send(json.dumps({"type": "text.append", "context_id": "c", "text": TEXT}))
        await ws.send(json.dumps({"type": "context.end", "context_id": "c"}))
        while types[-1] != "context.done":
            message = await asyncio.wait_for(ws.recv(), 60)
            if isinstance(message, str):
                types.append(json.loads(message)["type"])
        return types


def test_keys_come_from_the_environment_and_a_key_file(served_log):
    assert [served_log[key] for key in ("env-key-a81c44", KEY, "file-key-51d0e2")] == [200, 200, 200]
    assert served_log[None] == 401 and served_log["wrong-key-0c9b7d"] == 401
    assert served_log["query"] == 200 and served_log["events"][0] == "session.started"


def test_no_log_line_holds_a_key_or_the_users_text(served_log):
    log = served_log["log"]
    assert "GET /v1/voices?token=[redacted]" in log  # it logged them
    assert "context.done" in served_log["events"]
    for line in ("connection open", "[accepted]", "connection closed"):  # a session's own INFO lines are off
        assert line not in log
    for secret in (KEY, "env-key-a81c44", "file-key-51d0e2", "wrong-key-0c9b7d", TEXT, "Zebulon"):
        assert secret not in log
    assert "Traceback" not in log and "DeprecationWarning" not in log
    assert served_log["long"] == 200 and "(9013 characters)" in log  # a long query logged cut, saying how long
    assert max(len(line) for line in log.splitlines()) < 1500


def test_serve_on_a_busy_port_fails_at_once_with_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        run = voxgate("serve", "--port", port)
        output = run.communicate(timeout=60)[0]
    assert run.returncode == 2 and time.monotonic() - started < 15  # before the model loads
    assert output.strip().splitlines() == [f"voxgate: error: cannot listen on 127.0.0.1:{port}: Address already in use"]


@pytest.mark.parametrize("option,message", [
    (("--model", "/no/such/model"), "voxgate: error: --model /no/such/model: no such checkpoint directory"),
    (("--device", "cuda:7"), "voxgate: error: --device cuda:7: no such CUDA device"),
    (("--device", "abacus"), "voxgate: error: --device 'abacus' is not a device"),
])
def test_serve_refuses_a_missing_model_or_device_before_serving(option, message):
    started = time.monotonic()
    run = voxgate("serve", "--port", free_port(), *option)
    output = run.communicate(timeout=60)[0]
    assert run.returncode == 2 and time.monotonic() - started < 15, output
    assert len(output.strip().splitlines()) == 1 and output.startswith(message), output


def test_serve_exits_non_zero_when_the_model_does_not_load(tmp_path):
    run = voxgate("serve", "--port", free_port(), "--model", tmp_path)  # a directory, but no checkpoint in it
    output = run.communicate(timeout=60)[0]
    assert run.returncode == 1, output
    assert "start-up failed" in output and "Finished server process" in output and "Traceback" not in output


@pytest.mark.parametrize("content,message", [
    (None, "cannot read --api-key-file"), ("# only a comment\n\n", "holds no key"),
])
def test_a_missing_or_empty_key_file_is_one_clear_line(tmp_path, content, message):
    path = tmp_path / "keys.txt"
    if content is not None:
        path.write_text(content)
    run = voxgate("serve", "--api-key-file", path)
    output = run.communicate(timeout=60)[0]
    assert run.returncode == 2 and len(output.strip().splitlines()) == 1 and message in output


def test_max_connections_must_exceed_max_sessions():
    run = voxgate("serve", "--max-sessions", "10", "--max-connections", "10")
    output = run.communicate(timeout=60)[0]
    assert run.returncode == 2 and "--max-connections must be more than --max-sessions" in output
