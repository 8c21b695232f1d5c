"""A hostile client against a real server process (`voxgate serve`: uvicorn, the embedded tiny model, CPU).

`hypothesis` writes the messages: every message type with, in every field, a valid value, a JSON value of any
type, random Unicode (lone surrogates, bidi and zero-width marks, emoji, CJK, NUL, 100,000 characters) or an
out-of-range number (NaN, 2**64, 5,000 digits, deep nesting); now and then bytes that are not UTF-8 spliced into a
text frame; HTTP speech bodies the same way. Every example must
end in the documented success (the context speaks, the request gets audio) or a specific error code: never
`internal`, never a 500, never a session left hanging. The server process stays alive, and a healthy session
beside it keeps receiving audio the whole time.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from realtime.ws.protocol import ERROR_CODES
from realtime.http_transport import BYTES_PER_CHUNK, FREE_CHUNKS, LINGER_S
from tests.server_process import ServerProcess, server_process

MAX_MESSAGE_BYTES = 65536
SERVER_OPTIONS = ["--max-text-chars", "300", "--max-message-rate", "100000", "--max-contexts", "4",
                  "--max-message-bytes", str(MAX_MESSAGE_BYTES), "--max-sessions", "16"]
NEVER = {"internal", "synthesis_failed"}  # a fault inside the server, whatever the input
EXAMPLE_TIMEOUT_S = 60.0


# --- the server process and the healthy session beside it --------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServerProcess:
    with server_process(SERVER_OPTIONS, tmp_path_factory.mktemp("hostile") / "server.log") as running:
        yield running
    log = running.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-4000:]


class HealthySession(threading.Thread):
    """Speaks one short context after another on its own session, recording when each ended and how much audio it
    had, until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.spoken: list[tuple[float, int]] = []  # (when context.done arrived, audio frames)
        self.errors: list[object] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            asyncio.run(self._speak())
        except Exception as failure:  # reported by the test's assertions
            self.errors.append(repr(failure))

    async def _speak(self) -> None:
        async with connect(self.url, max_size=None) as ws:
            number = 0
            while not self.stopping.is_set():
                number += 1
                context_id = f"healthy-{number}"
                await ws.send(json.dumps({"type": "text.append", "context_id": context_id, "text": "Hello there."}))
                await ws.send(json.dumps({"type": "context.end", "context_id": context_id}))
                frames = 0
                while True:
                    message = await asyncio.wait_for(ws.recv(), 30)
                    if isinstance(message, bytes):
                        frames += 1
                        continue
                    parsed = json.loads(message)
                    if parsed["type"] == "error":
                        self.errors.append(parsed)
                    if parsed["type"] == "context.done":
                        break
                self.spoken.append((time.monotonic(), frames))


@pytest.fixture
def healthy(server):
    """A healthy session running beside the test; afterwards it must have spoken all along."""
    session = HealthySession(server.ws)
    session.start()
    started = time.monotonic()
    yield session
    ended = time.monotonic()
    session.stopping.set()
    session.join(60)
    assert not session.errors, session.errors
    assert session.spoken and all(frames > 0 for _, frames in session.spoken)
    times = [started] + [at for at, _ in session.spoken if at <= ended] + [ended]
    assert max(b - a for a, b in zip(times, times[1:])) < 20, "the healthy session went without audio for 20 s"
    server.assert_alive()


# --- what a hostile client sends ---------------------------------------------------------------------------------

# spliced into the JSON text as written; ESCAPED_QUOTES is an unterminated string of 100,000 escaped quotes (200 KB),
# which a regex that skipped strings to measure the nesting took minutes over, the whole server stalled
BIG_INTEGER, DEEP_NESTING, ESCAPED_QUOTES = "\x00big-integer\x00", "\x00deep-nesting\x00", "\x00escaped-quotes\x00"
SPECIAL_TEXT = ["\ud800", "ok\udfff", "\udc00\ud800", "\u202eevil\u202c", "zero\u200bwidth\u200d\ufeff",
                "\U0001F600\U0001F389", "\u4f60\u597d\u3002", "\x00nul\x00", "a" * 100_000, "\u0301",
                " ", "", "Hello there.", "\u0645\u0631\u062d\u0628\u0627", "**bold** `code`", "\n\t", "\uffff",
                BIG_INTEGER, DEEP_NESTING, ESCAPED_QUOTES]
surrogates = st.characters(categories=["Cs"])
texts = st.one_of(st.text(max_size=40), st.sampled_from(SPECIAL_TEXT),
                  st.builds(lambda a, b: a + b, st.text(max_size=8), surrogates),
                  st.text(st.characters(categories=["Cf", "Zs", "Mn", "Co", "Cc"]), max_size=10))
numbers = st.one_of(st.integers(), st.floats(), st.sampled_from(
    [2**63 - 1, 2**63, 2**64, -(2**63) - 1, -1, 0, 10**19, 10**30, 1e308, -0.0, 0.5, 24000, 48000, 8000]))
json_values = st.recursive(st.none() | st.booleans() | numbers | texts,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=3),
                           max_leaves=6)

VALID: dict[str, st.SearchStrategy] = {
    "context_id": st.sampled_from(["c1", "c2", "*", "x" * 128]),
    "text": st.sampled_from(["Hello there.", "Hi, how are you? ", "\u4f60\u597d\u3002", "Done."]),
    "flush": st.booleans(),
    "voice": st.sampled_from(["vivian", "ryan", "nobody", "VIVIAN"]),
    "instructions": st.sampled_from(["A calm voice.", "", "x" * 2001]),
    "language": st.sampled_from(["auto", "en", "English", "chinese", "klingon"]),
    "played_ms": st.sampled_from([0, 120.5, 10**9]),
    "name": st.sampled_from(["m1", "end"]),
    "id": st.sampled_from(["p1", 7, 1.5]),
    "mode": st.sampled_from(["graceful", "abort"]),
    "preset": st.sampled_from(["browser", "twilio", "pcm", "nope"]),
    "timestamps": st.sampled_from(["word", "none", "every"]),
    "audio": st.fixed_dictionaries({}, optional={
        "encoding": st.sampled_from(["opus", "pcm_s16le", "mulaw", "flac"]) | json_values,
        "sample_rate": st.sampled_from([8000, 16000, 24000, 48000, 44100, 22050]) | numbers,
        "frame_ms": st.sampled_from([10, 20, 40, 60]) | numbers,
        "bitrate": st.sampled_from([6000, 24000, 128000]) | numbers}),
    "transport": st.fixed_dictionaries({}, optional={"audio": st.sampled_from(["binary", "json"]) | json_values}),
    "text_options": st.fixed_dictionaries({}, optional={
        "buffering": st.sampled_from(["auto", "none", "sentence"]) | json_values,
        "max_buffer_delay_ms": st.sampled_from([0, 150, 10000]) | numbers}),
    "sampling": st.fixed_dictionaries({}, optional={
        name: numbers | json_values for name in ("temperature", "top_k", "top_p", "repetition_penalty", "seed")}),
}
FIELDS = {
    "session.start": ["voice", "language", "instructions", "audio", "transport", "preset", "text", "sampling",
                      "timestamps"],
    "text.append": ["context_id", "text", "flush", "voice", "instructions", "language"],
    "context.flush": ["context_id"], "context.end": ["context_id"], "context.cancel": ["context_id", "played_ms"],
    "mark": ["context_id", "name"], "keepalive": [], "ping": ["id"], "session.close": ["mode"],
}


@st.composite
def messages(draw) -> str | bytes:
    """One client message as it goes on the wire; bytes where it is not UTF-8 (sent in a text frame all the same)."""
    wire = draw(utf8_messages())
    if draw(st.integers(0, 9)):
        return wire
    raw = wire.encode()
    where = draw(st.integers(0, len(raw)))
    return raw[:where] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf"])) + raw[where:]


@st.composite
def utf8_messages(draw) -> str:
    kind = draw(st.sampled_from(list(FIELDS)) | st.sampled_from(list(FIELDS)) | texts | json_values)
    if not isinstance(kind, str) or kind not in FIELDS:
        return _wire(draw(st.fixed_dictionaries({"type": st.just(kind)}, optional={"context_id": texts}))
                     if draw(st.booleans()) else kind)
    message = {"type": kind}
    for name in FIELDS[kind]:
        if draw(st.integers(0, 3)):  # most fields present
            strategy = VALID["text_options"] if (kind, name) == ("session.start", "text") else VALID[name]
            message[name] = draw(st.one_of(strategy, strategy, json_values))
    if draw(st.booleans()):
        message["event_id"] = draw(st.sampled_from(["e1", 42]) | json_values)
    if draw(st.integers(0, 4)) == 0:
        message[draw(st.text(max_size=10))] = draw(json_values)
    return _wire(message)


def _wire(value: object) -> str:
    text = json.dumps(value)  # NaN and Infinity go out as written, as a careless client sends them
    return (text.replace(json.dumps(BIG_INTEGER), "9" * 5000)
            .replace(json.dumps(DEEP_NESTING), "[" * 5000 + "]" * 5000)
            .replace(json.dumps(ESCAPED_QUOTES), '"' + '\\"' * 100_000))


# --- the socket --------------------------------------------------------------------------------------------------

async def _exchange(url: str, wire: list[str | bytes]) -> None:
    """Send the messages, then close out every context that started (end it, wait for audio or its end, cancel
    all), checking every event on the way."""
    async with connect(url, max_size=None) as ws:
        events: list[dict] = []
        try:
            for message in wire:
                await ws.send(message, text=True)
            await ws.send(json.dumps({"type": "context.cancel", "context_id": "fin"}))  # acked in order
            await _read_until(ws, events, lambda: _acked(events, "fin"))
            open_ids = _open_contexts(events)
            for context_id in open_ids:
                await ws.send(json.dumps({"type": "context.end", "context_id": context_id}))
            await _read_until(ws, events, lambda: all(_settled(events, c) for c in open_ids))
            await ws.send(json.dumps({"type": "context.cancel", "context_id": "*"}))
            await ws.send(json.dumps({"type": "context.cancel", "context_id": "fin2"}))
            await _read_until(ws, events, lambda: _acked(events, "fin2"))
        except ConnectionClosed as closed:
            events += await _unread(ws)  # a send can meet the server's close before what it sent first is read
            _check_close(closed, wire, events)
        _check_events(events)


async def _read_until(ws, events: list[dict], done) -> None:
    deadline = time.monotonic() + EXAMPLE_TIMEOUT_S
    while not done():
        events.append(_event(await asyncio.wait_for(ws.recv(), max(0.1, deadline - time.monotonic()))))


async def _unread(ws) -> list[dict]:
    """The messages the server sent before its close that are still unread."""
    events = []
    with contextlib.suppress(ConnectionClosed):
        while True:
            events.append(_event(await asyncio.wait_for(ws.recv(), EXAMPLE_TIMEOUT_S)))
    return events


def _event(message: str | bytes) -> dict:
    return ({"type": "audio", "stream_id": int.from_bytes(message[2:4], "little")} if isinstance(message, bytes)
            else json.loads(message))


def _acked(events: list[dict], context_id: str) -> bool:
    return any(e.get("type") == "context.cancelled" and e.get("context_id") == context_id for e in events)


def _open_contexts(events: list[dict]) -> list[str]:
    started = [e["context_id"] for e in events if e.get("type") == "context.started"]
    return [c for c in started if not any(e.get("context_id") == c and e.get("type") in
                                          ("context.done", "context.cancelled") for e in events)]


def _settled(events: list[dict], context_id: str) -> bool:
    """The context spoke (its first audio arrived) or ended."""
    stream = next(e["stream_id"] for e in events if e.get("type") == "context.started"
                  and e["context_id"] == context_id)
    return any((e.get("type") == "audio" and (e.get("stream_id") == stream or e.get("context_id") == context_id))
               or (e.get("context_id") == context_id and e.get("type") in ("context.done", "context.cancelled"))
               for e in events)


def _check_events(events: list[dict]) -> None:
    for event in events:
        if event.get("type") == "error":
            assert event["code"] in ERROR_CODES and event["code"] not in NEVER, event
            assert event["fatal"] is False, event
    for event in events:  # a context that ended without audio says why, with a specific code
        if event.get("type") == "context.done" and not event["audio_ms"]:
            assert any(e.get("type") == "error" and e.get("context_id") == event["context_id"] for e in events)


def _check_close(closed: ConnectionClosed, wire: list[str | bytes], events: list[dict]) -> None:
    """The session may end only as documented: a message over the size limit (1009) or session.close (1000)."""
    code = closed.rcvd.code if closed.rcvd else None
    too_big = any(len(message if isinstance(message, bytes) else message.encode("utf-8", "surrogatepass"))
                  > MAX_MESSAGE_BYTES for message in wire)
    closing = any(e.get("type") == "session.closed" for e in events)
    assert (code == 1009 and too_big) or (code == 1000 and closing), (code, events[-5:])


@settings(max_examples=int(os.environ.get("HOSTILE_EXAMPLES", "120")), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(wire=st.lists(messages(), min_size=1, max_size=5))
@example(wire=['{"type": "session.close", "mode": "abort"}', '{}'])  # the close can overtake the reads (CI found)
def test_hostile_socket_messages_get_specific_errors_and_hurt_no_one(server, healthy, wire):
    asyncio.run(asyncio.wait_for(_exchange(server.ws, wire), 2 * EXAMPLE_TIMEOUT_S))
    assert server.process.poll() is None


# --- the speech endpoint ------------------------------------------------------------------------------------------

HTTP_VALID = {
    "model": st.sampled_from(["tts-1", "gpt-4o-mini-tts", "gpt-4o-mini-tts-2025-12-15", "whisper-1", "nope",
                              "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"]),
    "input": st.sampled_from(["Hello there.", "Hi!", "\u4f60\u597d\u3002"]),
    "voice": VALID["voice"] | st.sampled_from(["alloy", {"id": "cedar"}, {"id": 3}, {}]),
    "instructions": VALID["instructions"], "language": VALID["language"],
    "response_format": st.sampled_from(["pcm", "wav", "opus", "flac", "mp3", "aac", "ogg"]),
    "stream_format": st.sampled_from(["audio", "sse", "chunks"]),
    "speed": st.sampled_from([1.0, 1, 0.25, 0.5, 2.0, 4.0, 4.1, 0, None]),
    "seed": st.sampled_from([0, 2**63 - 1, 2**63, 2**64, -1]),
    "stream": st.booleans(),  # what tools written for the official Qwen3-TTS server send
    "non_streaming_mode": st.booleans(),
}


@st.composite
def speech_bodies(draw) -> bytes:
    if draw(st.integers(0, 9)) == 0:  # not a JSON object at all
        return draw(st.sampled_from([b"", b"{", b"\xff\xfe", b"null", b"[" * 3000, b"{\"input\": NaN}",
                                     b"{\"input\": \"a\", \"seed\": " + b"9" * 5000 + b"}",
                                     b"{\"input\": \"" + b'\\"' * 100_000,
                                     b"{\"input\": \"" + b"a" * (MAX_MESSAGE_BYTES + 10) + b"\"}"]) | st.binary())
    body = {}
    for name, valid in HTTP_VALID.items():
        if name == "input" or draw(st.integers(0, 2)) == 0:
            body[name] = draw(st.one_of(valid, valid, json_values))
    return _wire(body).encode("utf-8", "surrogatepass")


def _post(url: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=EXAMPLE_TIMEOUT_S) as response:
            return response.status, response.read(4096)  # the first audio is enough: the rest is cancelled
    except urllib.error.HTTPError as failure:
        return failure.code, failure.read()


@settings(max_examples=int(os.environ.get("HOSTILE_EXAMPLES", "120")), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(body=speech_bodies())
def test_hostile_speech_bodies_get_specific_errors_and_hurt_no_one(server, healthy, body):
    status, payload = _post(server.http + "/v1/audio/speech", body)
    if status == 200:
        assert payload, "a 200 without audio"
    else:
        error = json.loads(payload)["error"]
        assert status in (400, 413, 503) and error["code"] in ERROR_CODES and error["code"] not in NEVER, \
            (status, error)
    assert server.process.poll() is None


# --- requests HTTP/1.1 cannot parse ----------------------------------------------------------------------------

def _assert_json_400(answer: bytes) -> dict:
    """`answer` (a raw response read to the close) is a 400 with the API's JSON `invalid_message` error: the error."""
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 400 ") and b"application/json" in status, answer
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_message", error
    return error


_NOT_A_LENGTH = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=24).filter(
    lambda value: not value.strip(" \t").isdigit())


@settings(max_examples=int(os.environ.get("HOSTILE_EXAMPLES", "120")) // 4, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(head=st.one_of(
    _NOT_A_LENGTH.map(lambda value: f"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Length: {value}\r\n\r\n"),
    st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)).filter(lambda pair: pair[0] != pair[1]).map(
        lambda pair: f"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Length: {pair[0]}\r\n"
                     f"Content-Length: {pair[1]}\r\n\r\n"),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40).map(
        lambda line: f"{line}\r\n\r\n").filter(lambda head: " HTTP/" not in head)))
def test_a_request_http_cannot_parse_gets_the_apis_json_error(server, head):
    """A bad Content-Length (not a number, two that differ) or a request line that is not one: 400 with the API's
    JSON error (uvicorn's own answer was plain text), then the close; the server goes on."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=EXAMPLE_TIMEOUT_S) as raw:
        raw.sendall(head.encode())
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
    _assert_json_400(answer)
    assert server.get("/health")[0] == 200


@settings(max_examples=int(os.environ.get("HOSTILE_EXAMPLES", "120")) // 4, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(version=st.tuples(st.integers(0, 9), st.integers(0, 9)), target=st.sampled_from(["*", "/health"]),
       after=st.sampled_from([b"", b"SM\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"]))
@example(version=(2, 0), target="*", after=b"SM\r\n\r\n")  # HTTP/2's connection preface (prior knowledge)
def test_a_request_of_another_major_version_gets_one_answer_505_then_the_close(server, version, target, after):
    """A hostile try: HTTP/2's preface got a 404 ("PRI *" taken for a request), then a 400 for its "SM" line. A
    request of major version 1 (any minor, RFC 9110 2.5) is served; any other gets one JSON 505 and the close."""
    major, minor = version
    with socket.create_connection(("127.0.0.1", server.port), timeout=EXAMPLE_TIMEOUT_S) as raw:
        raw.sendall(f"GET {target} HTTP/{major}.{minor}\r\nHost: x\r\nConnection: close\r\n\r\n".encode() + after)
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
    if major == 1:
        assert not answer.startswith(b"HTTP/1.1 505 "), answer[:200]
    else:
        status, _, body = answer.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 505 ") and b"application/json" in status, answer[:300]
        length = int(status.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        assert len(body) == length, answer  # one answer: nothing after its body
        assert json.loads(body)["error"]["code"] == "invalid_message", answer
    assert server.get("/health")[0] == 200


@settings(max_examples=int(os.environ.get("HOSTILE_EXAMPLES", "120")) // 4, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(["/v1/audio/speech", "/v1/lexicons", "/health"]),
       length=st.sampled_from(["Content-Length", "content-length", "CONTENT-LENGTH"]),
       coding=st.sampled_from(["Transfer-Encoding", "transfer-encoding"]), length_first=st.booleans(),
       declared=st.integers(0, 64), chunk=st.binary(min_size=1, max_size=32))
def test_a_request_that_frames_its_body_two_ways_is_refused(server, route, length, coding, length_first, declared,
                                                           chunk):
    """Content-Length and Transfer-Encoding together (a request-smuggling vector behind a proxy that reads the
    other one): h11 took the chunked body and served the request; now 400 with the API's JSON error, then the close."""
    framing = [f"{length}: {declared}\r\n", f"{coding}: chunked\r\n"]
    head = (f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + "".join(framing if length_first else framing[::-1]) + "\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=EXAMPLE_TIMEOUT_S) as raw:
        raw.sendall(head + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n0\r\n\r\n")
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
    assert "Transfer-Encoding" in _assert_json_400(answer)["message"]
    assert server.get("/health")[0] == 200


@settings(max_examples=int(os.environ.get("HOSTILE_EXAMPLES", "120")) // 4, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(scheme=st.sampled_from(["http", "https", "HTTP", "ws"]),
       authority=st.sampled_from(["127.0.0.1", "127.0.0.1:1", "example.com", "user@host:8080", "[::1]:80", ""]),
       route=st.sampled_from([("/health", b'"status"'), ("/v1/models", b'"data"'), ("/v1/voices?x=%2F", b'"voices"')]))
def test_a_request_target_in_absolute_form_is_routed_by_its_path(server, scheme, authority, route):
    """RFC 9112: a server accepts `GET http://host/path` (what a client behind a proxy may send); it got 404, as
    uvicorn passed the whole target on as the path. Now it is served as its path is; the authority is not used."""
    path, expected = route
    with socket.create_connection(("127.0.0.1", server.port), timeout=EXAMPLE_TIMEOUT_S) as raw:
        raw.sendall(f"GET {scheme}://{authority}{path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 ") and expected in answer, answer[:300]


# --- WebSocket handshakes -----------------------------------------------------------------------------------------

def _handshake(port: int, extra_headers: bytes, key: bool = True, path: bytes = b"/v1/tts/stream") -> bytes:
    """A raw WebSocket opening handshake (on /v1/tts/stream): the response, up to the close (the head of a 101)."""
    head = (b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            + (b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n" if key else b"")
            + b"Sec-WebSocket-Version: 13\r\n" + extra_headers + b"\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=EXAMPLE_TIMEOUT_S) as raw:
        raw.sendall(head)
        answer = b""
        while (b"\r\n\r\n" not in answer or not answer.startswith(b"HTTP/1.1 101 ")) and (chunk := raw.recv(65536)):
            answer += chunk  # a refusal is read to the close
    return answer


def test_a_socket_opened_with_an_absolute_target_starts_its_session(server):
    assert _handshake(server.port, b"", path=b"ws://127.0.0.1/v1/tts/stream").startswith(b"HTTP/1.1 101 ")


@settings(max_examples=int(os.environ.get("HOSTILE_EXAMPLES", "120")) // 4, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from([b"User-Agent", b"Cookie", b"X-Anything", b"Origin-Hint"]),
       value=st.binary(min_size=1, max_size=60).map(
           lambda raw: bytes(b for b in raw if b >= 0x20 and b != 0x7F).strip() or b"\xc3\xa9"))
def test_a_handshake_header_of_any_bytes_opens_the_session(server, name, value):
    """Header bytes that are not ASCII (a browser's UTF-8 cookie, any byte HTTP allows in a value) failed the
    handshake with a 500 and a traceback (the module's server log is checked for tracebacks when it stops): the
    socket opens as any other."""
    answer = _handshake(server.port, name + b": " + value + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 101 "), answer[:200]


@pytest.mark.parametrize("extra, key", [(b"", False), (b"X-Control: a\x01b\r\n", True),
                                        (b"Sec-WebSocket-Version: 8\r\n", True)],
                         ids=["no-key", "control-byte", "two-versions"])
def test_a_request_that_is_no_websocket_handshake_gets_the_apis_json_error(server, extra, key):
    """No key, a control byte in a header (not a valid HTTP header value), a second version: 400 with the API's JSON
    error (the library answered plain text)."""
    answer = _handshake(server.port, extra, key=key)
    _assert_json_400(answer)
    assert server.get("/health")[0] == 200


@settings(max_examples=int(os.environ.get("HOSTILE_EXAMPLES", "120")) // 4, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(path=st.one_of(st.sampled_from(["/", "/health", "/v1/audio/speech", "/v1/voices", "/static/app.js",
                                       "/static/../x", "/v1/tts/stream/", "/v1/chat/x"]),
                      st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40).map("/".__add__)))
def test_a_websocket_handshake_where_no_websocket_endpoint_is_gets_the_apis_json_404(server, path):
    """A WebSocket opening on an HTTP route or an unknown path got starlette's empty 403 (and under /static, the
    files' app asserted: a 500 and a traceback): it is the API's JSON 404 naming the WebSocket endpoints."""
    assume(path not in ("/v1/tts/stream", "/v1/chat"))
    answer = _handshake(server.port, b"", path=path.encode())
    status, _, body = answer.partition(b"\r\n\r\n")
    if status.startswith(b"HTTP/1.1 400 "):  # a target h11 or the library refuses as a request line: its own JSON
        assert json.loads(body)["error"]["code"] == "invalid_message"
        return
    assert status.startswith(b"HTTP/1.1 404 ") and b"application/json" in status, answer[:300]
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_message" and "/v1/tts/stream" in error["message"]
    assert server.get("/health")[0] == 200


# --- bodies cut short ---------------------------------------------------------------------------------------------

BODY_ROUTES = ["/v1/audio/speech", "/v1/lexicons", "/v1/audio/voices"]


@settings(max_examples=int(os.environ.get("HOSTILE_EXAMPLES", "120")) // 4, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(BODY_ROUTES), sent=st.binary(max_size=200),
       missing=st.one_of(st.integers(1, 1000), st.integers(1, 10**6)), multipart=st.booleans())
def test_a_client_that_leaves_mid_body_gets_no_traceback(server, route, sent, missing, multipart):
    """A client that declares a body and leaves before all of it arrived: nothing to answer, no error logged (the
    module's server log is checked for tracebacks when it stops), and the server goes on serving."""
    content_type = "multipart/form-data; boundary=b" if multipart else "application/json"
    head = (f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(sent) + missing}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=EXAMPLE_TIMEOUT_S) as raw:
        raw.sendall(head + sent)
        time.sleep(0.05)  # the server reads what came, then waits for the rest
    assert server.get("/health")[0] == 200
    assert server.process.poll() is None


def _read_answer(raw: socket.socket) -> tuple[bytes, bytes]:
    """One HTTP response off the socket (its head and its Content-Length body), no further."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += raw.recv(65536)
    head, _, body = answer.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += raw.recv(65536)
    return head, body


@settings(max_examples=int(os.environ.get("HOSTILE_EXAMPLES", "120")) // 8, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(["/v1/audio/speech", "/v1/lexicons"]), over=st.integers(1, 2 * 10**6),
       piece=st.integers(16_384, 65_536), keep_alive=st.booleans())
def test_a_body_refused_from_its_length_is_read_to_its_end(server, route, over, piece, keep_alive):
    """A request whose Content-Length passes the limit is answered (413) before its body is read. A client that
    sends its whole body before it reads (urllib, curl with `Connection: close`) got a reset, not the answer: the
    server closed with the body still coming. Now it reads the rest of the body, drops it and closes at its end;
    a kept-alive request's answer says `Connection: close` too (its body was read for as long as it came)."""
    declared = MAX_MESSAGE_BYTES + over
    head = (f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {declared}\r\n"
            + ("" if keep_alive else "Connection: close\r\n") + "\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=EXAMPLE_TIMEOUT_S) as raw:
        raw.sendall(head.encode())
        status, body = _read_answer(raw)
        assert status.startswith(b"HTTP/1.1 413 ") and json.loads(body)["error"]["code"] == "text_too_long"
        assert b"\r\nconnection: close" in status.lower()
        time.sleep(0.02)  # the server has closed by now if it does not linger
        for start in range(0, declared, piece):
            raw.sendall(b"a" * min(piece, declared - start))
        raw.settimeout(LINGER_S / 2)  # closed at the body's end, not when the linger runs out
        assert raw.recv(1) == b""


def _chunked(body: bytes, cuts: list[int]) -> bytes:
    """`body` in chunks cut at the given positions, then the last chunk."""
    ends = [0, *sorted(set(cuts)), len(body)]
    pieces = [body[start:end] for start, end in zip(ends, ends[1:]) if end > start]
    return b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"


def _post_chunked(port: int, route: str, chunked: bytes) -> bytes:
    """A raw chunked POST, read to the close (the request says `Connection: close`)."""
    head = (f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=EXAMPLE_TIMEOUT_S) as raw:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused and closed while it was sending
            raw.sendall(head + chunked)
        answer = b""
        with contextlib.suppress(ConnectionResetError):  # (a timeout is not suppressed: the server must close)
            while chunk := raw.recv(65536):
                answer += chunk
    return answer


@settings(max_examples=int(os.environ.get("HOSTILE_EXAMPLES", "120")) // 8, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(["/v1/audio/speech", "/v1/lexicons", "/nope"]), size=st.integers(1, 64),
       chunks=st.integers(FREE_CHUNKS + 2, 5_000))
def test_a_chunked_body_of_tiny_chunks_is_refused_before_it_costs(server, healthy, route, size, chunks):
    """h11 parses each chunk in Python: a body of one-byte chunks held the event loop for seconds (every other
    stream's audio with it). Chunks that average under BYTES_PER_CHUNK, past FREE_CHUNKS of them, are a 400 and
    the close (a route that answers before it reads, 404, may have answered first: then the close comes at that
    chunk); the healthy session beside it stays smooth (the module's `healthy` fixture)."""
    assume(chunks > FREE_CHUNKS + size * chunks // BYTES_PER_CHUNK)
    answer = _post_chunked(server.port, route, _chunked(b"a" * size * chunks, list(range(size, size * chunks, size))))
    if not (route == "/nope" and answer.startswith(b"HTTP/1.1 404 ")):
        assert "chunks" in _assert_json_400(answer)["message"]
    assert server.get("/health")[0] == 200


_SPEECH_BODY = json.dumps({"input": "Hi there.", "voice": "vivian", "response_format": "pcm", "stream": False}).encode()


@settings(max_examples=int(os.environ.get("HOSTILE_EXAMPLES", "120")) // 8, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(cuts=st.lists(st.integers(1, len(_SPEECH_BODY) - 1), max_size=FREE_CHUNKS - 1))
def test_a_chunked_body_in_a_few_pieces_is_served(server, cuts):
    """A client that streams its body (curl from stdin, a fetch of a stream) sends it chunked: up to FREE_CHUNKS
    pieces of any size are read as the same body."""
    answer = _post_chunked(server.port, "/v1/audio/speech", _chunked(_SPEECH_BODY, cuts))
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
