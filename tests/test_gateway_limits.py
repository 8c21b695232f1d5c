"""Limits of a session on a real server: idle timeout, message rate, the Origin allow-list, readiness turning 503
when the engine fails, and the session and connection limits following the engine's slots."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from websockets.asyncio.client import connect
from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State
from websockets.uri import parse_uri

from realtime.gateway import Limits
from realtime.ws import speech_context
from realtime.ws.backpressure import MAX_QUEUED_ITEMS
from tests.gateway_server import SHORT_SPEECH, events_until_closed, running_server


@pytest.fixture(scope="module")
def server():
    with running_server(Limits(idle_timeout_s=1.0, max_message_rate=20.0,
                               allowed_origins=("https://app.example",))) as running:
        yield running


async def closing_events(ws) -> tuple[list[dict], int | None]:
    """The session's events (audio frames left out) up to its close, and the close code."""
    events = []
    try:
        while True:
            message = await asyncio.wait_for(ws.recv(), 20)
            if isinstance(message, str):
                events.append(json.loads(message))
    except ConnectionClosed as closed:
        return events, closed.rcvd.code if closed.rcvd else None


def test_idle_sessions_are_closed_with_4008_but_keepalive_holds_them(server):
    async def go():
        async with connect(server.ws) as ws:
            assert json.loads(await ws.recv())["type"] == "session.started"
            for _ in range(4):  # 2 s of keepalives: longer than the timeout, still open
                await asyncio.sleep(0.5)
                await ws.send(json.dumps({"type": "keepalive"}))
            await ws.send(json.dumps({"type": "ping", "id": 1}))
            assert json.loads(await ws.recv())["type"] == "pong"
            events, code = await closing_events(ws)
            assert code == 4008 and events[-1]["code"] == "idle_timeout" and events[-1]["fatal"] is True
    asyncio.run(go())


def test_a_context_held_open_without_text_does_not_keep_an_idle_session(server):
    """PROTOCOL.md: the idle timer runs while no context is generating or sending. A client that opens a context
    and goes quiet (no end) leaves it held, waiting for text, once its words so far are spoken (they are read after
    a pause, docs/protocol.md): that is idle, and its engine slot is freed by the close, where it was kept for
    good. The context is cancelled with reason `timeout` after the error, before the close."""
    async def go():
        async with connect(server.ws) as ws:
            assert json.loads(await ws.recv())["type"] == "session.started"
            await ws.send(json.dumps({"type": "session.start", "text": {"buffering": "none"}}))
            await ws.send(json.dumps({"type": "text.append", "context_id": "held", "text": "Hello there"}))
            started = time.monotonic()
            events, code = await closing_events(ws)
            return events, code, time.monotonic() - started

    events, code, waited = asyncio.run(go())
    assert code == 4008 and events[-2]["code"] == "idle_timeout", events[-3:]
    assert waited < 15
    # the context still gets its final event, with PROTOCOL.md's reason (a hostile try: it got none)
    assert events[-1]["type"] == "context.cancelled" and events[-1]["context_id"] == "held", events[-3:]
    assert events[-1]["reason"] == "timeout"


def test_a_client_that_floods_and_never_reads_is_closed_not_buffered_for(server):
    """Each message past the rate gets its `rate_limited` error; a client that sends 60,000 and reads none made the
    server hold every error (500 MB for 2M messages). Past MAX_QUEUED_ITEMS waiting to be sent, the session ends
    as a slow consumer (1008) and the server still serves."""
    async def go():
        # A client that really reads nothing: its library stops reading the socket once 4 messages wait, and the
        # socket's receive buffer is small and fixed. (Reading in the background into an unbounded queue, with
        # buffers the kernel grew to megabytes, all 60,000 errors fitted on their way, the outbox never filled,
        # and the session went idle instead: 4008.)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16_384)
        uri = parse_uri(server.ws)
        sock.connect((uri.host, uri.port))
        async with connect(server.ws, max_queue=4, sock=sock) as ws:
            for _ in range(60_000):
                await ws.send("x")
            # still reading nothing until the server has handled what was sent: on a loaded machine the server (a
            # thread of this process) lagged the sends, the client's reading began first, the queue drained as fast
            # as it filled, and the session went idle (4008) instead
            deadline = time.monotonic() + 120
            while server.metric("voxgate_sessions_active") > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            events, code = await closing_events(ws)
            return events, code

    events, code = asyncio.run(go())
    assert code == 1008 and len(events) < 60_000  # closed, the errors past the queue's limit never made
    assert events[0]["type"] == "session.started" and {event["type"] for event in events[1:]} == {"error"}
    codes = [event["code"] for event in events[1:]]
    # "x" within the rate is bad JSON, past it dropped unread; the fatal error, when it came, is the last
    assert set(codes[:-1]) <= {"invalid_json", "rate_limited"} and codes[-1] in ("rate_limited", "slow_consumer")
    if codes[-1] == "slow_consumer":  # sent ahead of the queue if the client reads within ABORT_GRACE_S of it; this
        # one reads only once its 60,000 sends are done (6 s on an idle 2-core box), after which it gets the close
        assert events[-1]["fatal"] is True and str(MAX_QUEUED_ITEMS) in events[-1]["message"]
    assert server.get("/health")[0] == 200


class RawClient:
    """A WebSocket client on a plain TCP socket (websockets' sans-I/O protocol): it closes the socket only when told
    to, whatever the protocol says, as a careless or hostile peer may."""

    def __init__(self, url: str) -> None:
        uri = parse_uri(url)
        self.protocol = ClientProtocol(uri)
        self.sock = socket.create_connection((uri.host, uri.port), timeout=10)
        self.protocol.send_request(self.protocol.connect())
        self.flush()

    def flush(self) -> None:
        for data in self.protocol.data_to_send():
            if data:
                self.sock.sendall(data)

    def read(self, until) -> None:
        """Reads (answering what the protocol answers) until `until(protocol)` holds."""
        while not until(self.protocol):
            data = self.sock.recv(65536)
            assert data, "the server closed the connection before what the test waits for"
            self.protocol.receive_data(data)
            self.protocol.events_received()
            self.flush()


@pytest.mark.parametrize("how", ["oversized message", "close frame"])
def test_a_session_ends_with_its_websocket_even_if_the_peer_keeps_tcp_open(server, how):
    """A peer that keeps its TCP connection open after the WebSocket closed (the server failed it with 1009, or the
    peer sent its own close frame) no longer holds a session, so it cannot keep others out under --max-sessions.
    (The legacy protocol waited up to 10 s for the TCP close before telling the app.)"""
    sessions = server.server.gateway.sessions
    client = RawClient(server.ws)
    try:
        client.read(lambda protocol: protocol.state is State.OPEN)
        deadline = time.monotonic() + 10
        while not sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(sessions) == 1
        if how == "oversized message":
            client.protocol.send_text(b"x" * (server.server.gateway.limits.max_message_bytes + 1))
        else:
            client.protocol.send_close(1000)
        client.flush()
        client.read(lambda protocol: protocol.close_rcvd is not None)
        assert client.protocol.close_rcvd.code == (1009 if how == "oversized message" else 1000)
        deadline = time.monotonic() + 2
        while sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not sessions, "the session outlived its WebSocket's close"
    finally:
        client.sock.close()


def test_messages_past_the_rate_are_dropped_with_rate_limited(server):
    async def go():
        async with connect(server.ws) as ws:
            await ws.recv()
            for i in range(60):  # a burst of 60 against 20/s with bursts of 40
                await ws.send(json.dumps({"type": "ping", "id": i}))
            answers = [json.loads(await asyncio.wait_for(ws.recv(), 10)) for _ in range(60)]
            limited = [a for a in answers if a["type"] == "error"]
            assert 15 <= len(limited) <= 25 and all(a["code"] == "rate_limited" for a in limited)
            assert len([a for a in answers if a["type"] == "pong"]) == 60 - len(limited)
    asyncio.run(go())


def test_binary_frames_count_against_the_same_budget(server):
    """A binary frame from the client is refused (invalid_message) within the message budget, as text is: a flood of
    them is rate_limited rather than answered one by one (a hostile try's finding: they skipped the budget)."""
    async def go():
        async with connect(server.ws) as ws:
            await ws.recv()
            for _ in range(60):  # a burst of 60 against 20/s with bursts of 40
                await ws.send(b"\x00\x01\x02")
            answers = [json.loads(await asyncio.wait_for(ws.recv(), 10)) for _ in range(60)]
            codes = [a["code"] for a in answers]
            assert 15 <= codes.count("rate_limited") <= 25, codes
            assert codes.count("invalid_message") == 60 - codes.count("rate_limited")
    asyncio.run(go())


def test_a_dropped_message_is_named_in_its_error_and_text_has_a_byte_budget(server):
    """A hostile try: 450 appends and a context.end past the rate got errors naming none of them, so the client could
    not tell which were dropped. A small dropped message's error carries its event_id and context_id. And parsing
    costs by the byte: the text a socket sends is budgeted too (twice max_message_bytes a second, bursts of twice
    that), whatever the message count."""
    async def go():
        async with connect(server.ws) as ws:
            await ws.recv()
            for i in range(60):
                await ws.send(json.dumps({"type": "ping", "id": i, "context_id": f"c{i}", "event_id": f"e{i}"}))
            answers = [json.loads(await asyncio.wait_for(ws.recv(), 10)) for _ in range(60)]
            limited = [a for a in answers if a["type"] == "error" and a["code"] == "rate_limited"]
            assert limited and all(a["event_id"] == "e" + a["context_id"][1:] for a in limited), limited
        async with connect(server.ws) as ws:
            await ws.recv()
            big = json.dumps({"type": "ping", "id": 0, "pad": "x" * (server.gateway.limits.max_message_bytes - 100)})
            for _ in range(6):  # 6 near-limit messages at once: the burst holds 4
                await ws.send(big)
            answers = [json.loads(await asyncio.wait_for(ws.recv(), 10)) for _ in range(6)]
            codes = [a.get("code", a["type"]) for a in answers]
            assert codes.count("rate_limited") >= 1 and "KiB" in next(a["message"] for a in answers
                                                                       if a.get("code") == "rate_limited"), codes
    asyncio.run(go())


def test_an_end_and_a_cancel_past_the_rate_are_still_handled():
    """Hostile try 12: clients that send an LLM's burst as one append per token lost the context.end behind them to
    the rate limit, and their turns hung (no context.done) or held a context each until the session hit its limit.
    Past the rate, appends and flushes are dropped (rate_limited, named: a flush queues work, so the rate bounds it);
    the cancel and end after them are handled. A repeated end, or a cancel of a context that is not open, acts on
    nothing: past the rate it is dropped too (a hostile try's 20,000 cancels of nothing slowed other sessions)."""
    with running_server(Limits(max_message_rate=20.0), synthetic_frames_per_token=SHORT_SPEECH) as server:
        async def go():
            async with connect(server.ws) as ws:
                await ws.recv()
                for context_id in ("a", "b"):
                    await ws.send(json.dumps({"type": "text.append", "context_id": context_id, "text": "Hello"}))
                for i in range(60):  # a burst of 60 against 20/s with bursts of 40
                    await ws.send(json.dumps({"type": "text.append", "context_id": "a", "text": f" w{i}",
                                              "event_id": f"w{i}"}))
                for kind, context_id, event_id in (("context.flush", "a", "flush"), ("context.cancel", "b", "cancel"),
                                                   ("context.end", "a", "end"), ("context.end", "a", "end again"),
                                                   ("context.cancel", "b", "cancel again"),
                                                   ("context.cancel", "zzz", "cancel of nothing")):
                    await ws.send(json.dumps({"type": kind, "context_id": context_id, "event_id": event_id}))
                events = []
                async with asyncio.timeout(60):
                    while not any(e["type"] == "context.done" for e in events):
                        message = await ws.recv()
                        if isinstance(message, str):
                            events.append(json.loads(message))
            limited = [e["event_id"] for e in events if e.get("code") == "rate_limited"]
            acting_on_nothing = {"end again", "cancel again", "cancel of nothing"}
            assert acting_on_nothing <= set(limited) <= {f"w{i}" for i in range(60)} | {"flush"} | acting_on_nothing
            kinds = {(e["type"], e.get("context_id")) for e in events}
            assert {("context.cancelled", "b"), ("context.done", "a")} <= kinds, kinds
        asyncio.run(go())


def test_origin_allow_list(server):
    async def go():
        async with connect(server.ws, origin="https://evil.example") as ws:
            events, code = await closing_events(ws)
            assert code == 1008 and events == [events[0]] and events[0]["code"] == "unauthorized"
        async with connect(server.ws, origin="https://app.example") as ws:
            assert json.loads(await ws.recv())["type"] == "session.started"
    asyncio.run(go())


@pytest.mark.parametrize("origin, status", [("https://evil.example", 403), ("https://app.example", 200), (None, 200)])
def test_the_http_api_takes_the_origins_the_socket_takes(server, origin, status):
    """A cross-site form post (text/plain: no preflight) from a page the allow list does not name must not store
    a lexicon; a listed origin, and a client that is no browser (no Origin), are served."""
    headers = {"Content-Type": "text/plain", **({"Origin": origin} if origin else {})}
    body = json.dumps({"name": f"lx{status}{bool(origin)}", "rules": [{"term": "a", "replacement": "b"}]})
    response = httpx.post(server.http + "/v1/lexicons", content=body, headers=headers)
    assert response.status_code in ((403,) if status == 403 else (200, 201)), response.text
    if status == 403:
        assert response.json()["error"]["code"] == "unauthorized"


@pytest.mark.parametrize("origin, method, headers, status", [
    ("https://app.example", "POST", "authorization, content-type", 200),
    ("https://app.example", "DELETE", None, 200),
    ("https://evil.example", "POST", "content-type", 403),
    ("https://app.example", "PUT", None, 400),
    ("https://app.example", "POST", "x-forwarded-for", 400),
    ("https://app.example", "POST", "authorization, content-type, x-stainless-os, x-stainless-retry-count, "
                                    "openai-organization", 200),  # OpenAI's JS SDK in a page
    ("https://app.example", "POST", "x-stainless-os, x-forwarded-for", 400),
    ("https://app.example", "POST", "", 200),  # an empty list (a hostile try: refused as a header not taken)
    ("https://app.example", "POST", "authorization, , content-type,", 200)])
def test_a_listed_origins_page_may_call_the_http_api_through_cors(server, origin, method, headers, status):
    """A page on an origin the allow list names calls the API with its key and a JSON body, which needs a CORS
    preflight: it was a 405, so only the socket served such a page. The preflight is answered for the API's
    methods and headers; another origin, method or header is refused with the API's JSON error; a listed origin's
    response lets its script read the audio's headers."""
    asked = {"Origin": origin, "Access-Control-Request-Method": method,
             **({"Access-Control-Request-Headers": headers} if headers is not None else {})}
    preflight = httpx.options(server.http + "/v1/audio/speech", headers=asked)
    assert preflight.status_code == status, preflight.text
    if status == 200:
        assert preflight.headers["access-control-allow-origin"] == origin
        assert method in preflight.headers["access-control-allow-methods"]
        allowed = {name.strip().lower() for name in preflight.headers["access-control-allow-headers"].split(",")}
        assert {name.strip() for name in (headers or "").split(",") if name.strip()} <= allowed
    else:
        assert preflight.json()["error"]["code"] == ("unauthorized" if status == 403 else "invalid_message")
    if status == 200 and method == "POST":
        spoken = httpx.post(server.http + "/v1/audio/speech", headers={"Origin": origin}, timeout=60,
                            json={"input": "Hi.", "response_format": "pcm", "stream": False})
        assert spoken.status_code == 200 and spoken.headers["access-control-allow-origin"] == origin
        assert "X-Audio-Samples" in spoken.headers["access-control-expose-headers"]


def test_ready_turns_503_when_the_engine_fails(server):
    server.gateway.engine.error = "RuntimeError: CUDA error: an illegal memory access"
    try:
        status, body = server.get("/ready")
        assert status == 503 and "illegal memory access" in json.loads(body)["status"]
        assert server.get("/health")[0] == 200
        status, headers, body = server.post("/v1/audio/speech", {"input": "Hello."})
        assert status == 503 and json.loads(body)["error"]["code"] == "overloaded"
        assert headers.get("retry-after") == "1"  # when to try again (hostile try 12: a 503 said nothing of it)
    finally:
        server.gateway.engine.error = None


def test_shutdown_finishes_or_cancels_contexts_and_closes_with_1001():
    with running_server() as server:
        async def go():
            async with connect(server.ws) as ws:
                await ws.recv()
                await ws.send(json.dumps({"type": "text.append", "context_id": "ended", "text": "Done soon."}))
                await ws.send(json.dumps({"type": "context.end", "context_id": "ended"}))
                await ws.send(json.dumps({"type": "text.append", "context_id": "open", "text": "Still typing"}))
                await asyncio.sleep(0.3)
                server.server.should_exit = True  # what SIGTERM does
                events, code = await events_until_closed(ws)
                kinds = [(e["type"], e.get("context_id"), e.get("reason")) for e in events]
                assert ("context.done", "ended", None) in kinds
                assert ("context.cancelled", "open", "shutdown") in kinds
                assert kinds[-1][0] == "session.closed" and code == 1001
        asyncio.run(go())


def test_session_and_connection_limits_follow_the_engine_slots():
    """Unset, the session limit is the engine's slots once they are more than 64 (a GPU-sized engine; --max-batch is
    the CPU's way to get them), the connection cap 2 x that + 64 with it; /ready says so. The last session and the
    last connection the limits allow are let in; the next session is refused, the next connection closes the oldest
    silent one to get in (http_transport.py)."""
    slots = 70
    with running_server(max_batch=slots) as server:
        capacity = json.loads(server.get("/ready")[1])
        assert capacity == {"ready": True, "status": "ready", "engine_slots": slots, "max_sessions": slots,
                            "max_connections": 2 * slots + 64}

        async def sessions() -> None:
            async with contextlib.AsyncExitStack() as opened:
                for _ in range(slots):
                    ws = await opened.enter_async_context(connect(server.ws))
                    assert json.loads(await ws.recv())["type"] == "session.started"
                async with connect(server.ws) as refused:
                    events, code = await closing_events(refused)
                    assert code == 1013 and events[-1]["code"] == "overloaded"
                    assert f"maximum of {slots} sessions" in events[-1]["message"]
        asyncio.run(sessions())

        host, port = server.http.removeprefix("http://").split(":")
        sockets = [socket.create_connection((host, int(port)), timeout=5) for _ in range(2 * slots + 64)]
        try:
            with socket.create_connection((host, int(port)), timeout=5) as over:
                assert sockets[0].recv(4096).startswith(b"HTTP/1.1 503")  # the oldest silent one, closed for room
                over.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert over.recv(4096).startswith(b"HTTP/1.1 200")
            sockets[-1].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sockets[-1].recv(4096).startswith(b"HTTP/1.1 200")
        finally:
            for sock in sockets:
                sock.close()


def test_one_api_key_cannot_take_every_session():
    """--max-sessions-per-key: a key's sessions past the limit get error{overloaded} naming it and 1013, while
    another key still opens; a closed session gives its key the room back. The key may come as a header or as
    `?token=`: they count as one. Chat sockets are capped the same way (a review: one key could take them all)."""
    with running_server(Limits(api_keys=("tenant-a", "tenant-b"), max_sessions_per_key=2)) as server:
        def opening(key: str, header: bool = True):
            if header:
                return connect(server.ws, additional_headers={"Authorization": f"Bearer {key}"})
            return connect(f"{server.ws}?token={key}")

        async def go() -> None:
            async with opening("tenant-a") as first, opening("tenant-a", header=False) as second:
                for ws in (first, second):
                    assert json.loads(await ws.recv())["type"] == "session.started"
                async with opening("tenant-a") as third:
                    events, code = await closing_events(third)
                    assert code == 1013 and events[-1]["code"] == "overloaded" and events[-1]["fatal"]
                    assert "this API key has its maximum of 2 open sessions" in events[-1]["message"]
                async with opening("tenant-b") as other:
                    assert json.loads(await other.recv())["type"] == "session.started"
                await second.close()
                for _ in range(100):  # the server sees the close a moment later
                    if server.gateway.sessions_of("tenant-a") < 2:
                        break
                    await asyncio.sleep(0.05)
                async with opening("tenant-a") as again:
                    assert json.loads(await again.recv())["type"] == "session.started"

        async def chats() -> None:  # a page's chat socket beside its session: capped the same way
            url = server.ws.replace("/v1/tts/stream", "/v1/chat") + "?token="
            async with connect(url + "tenant-a") as first, connect(url + "tenant-a") as second:
                for chat in (first, second):
                    assert json.loads(await chat.recv())["type"] == "chat.ready"
                async with connect(url + "tenant-a") as third:
                    events, code = await closing_events(third)
                    assert code == 1013 and events[-1]["code"] == "overloaded"
                    assert "this API key has its maximum of 2 open chat sockets" in events[-1]["message"]
                async with connect(url + "tenant-b") as other:
                    assert json.loads(await other.recv())["type"] == "chat.ready"
        asyncio.run(go())
        asyncio.run(chats())


async def context_done(ws, context_id: str) -> list[dict]:
    """The JSON events up to `context_id`'s context.done."""
    events = []
    while not events or events[-1].get("type") != "context.done" or events[-1].get("context_id") != context_id:
        message = await asyncio.wait_for(ws.recv(), 60)
        if isinstance(message, str):
            events.append(json.loads(message))
    return events


# what a client may send while its text has stopped: keepalives, or text with nothing to say (a hostile try held
# every slot of the engine with a space a context every 3.5 s: text, but none to speak)
NOTHING_TO_SAY = [{"type": "keepalive"}] + [{"type": "text.append", "context_id": "paused", "text": text}
                                            for text in (" ", ",", "\n", "\u200b ", "!?", " - ")]


@pytest.mark.parametrize("filler", ["keepalive", "blank text"])
def test_a_context_whose_text_stops_gives_its_engine_slot_back_and_speaks_on_when_text_comes(monkeypatch, filler):
    """A client that opens contexts, stops their text and keeps its session alive (keepalives, or text with no letter
    or digit) held engine slots for good (hostile tries held every slot so): after TEXT_PAUSE_S without text to say
    the utterance being spoken closes, its request ends, and later text starts the next utterance of the context."""
    monkeypatch.setattr(speech_context, "TEXT_PAUSE_S", 0.5)
    fillers = NOTHING_TO_SAY[:1] if filler == "keepalive" else NOTHING_TO_SAY[1:]
    first = "Hello there my friend"

    async def go(running):
        async with connect(running.ws) as ws:
            assert json.loads(await ws.recv())["type"] == "session.started"
            await ws.send(json.dumps({"type": "session.start", "text": {"buffering": "none"}}))
            await ws.send(json.dumps({"type": "text.append", "context_id": "whole", "text": first}))
            await ws.send(json.dumps({"type": "context.end", "context_id": "whole"}))
            whole = await context_done(ws, "whole")
            await ws.send(json.dumps({"type": "text.append", "context_id": "paused", "text": first}))
            deadline = time.monotonic() + 60
            while running.metric("voxgate_engine_requests_active") == 0:  # its first utterance is speaking
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            sent = 0
            while running.metric("voxgate_engine_requests_active") != 0:  # ... and ends, with no text coming
                assert time.monotonic() < deadline, "a context with no text coming kept its engine slot"
                await ws.send(json.dumps(fillers[sent % len(fillers)]))
                sent += 1
                await asyncio.sleep(0.1)
            await ws.send(json.dumps({"type": "text.append", "context_id": "paused", "text": " and more words."}))
            await ws.send(json.dumps({"type": "context.end", "context_id": "paused"}))
            paused = await context_done(ws, "paused")
            return whole, paused

    with running_server(Limits(), synthetic_frames_per_token=SHORT_SPEECH) as running:
        whole, paused = asyncio.run(go(running))
    assert not [e for e in whole + paused if e["type"] == "error"]
    # the later text was spoken too: more audio than the first text alone (lengths follow the text's tokens)
    assert paused[-1]["audio_ms"] > whole[-1]["audio_ms"] > 0


def test_text_that_trickles_in_gives_its_slot_to_a_waiting_request():
    """A session that keeps every engine slot with text that trickles in (a letter a context every second: never a
    5 s pause) made every other session wait for as long as it liked (a hostile try: no audio for another session
    while it ran). While a request waits for a slot, an utterance quiet for CONTENDED_PAUSE_S closes: the other
    session speaks, and the trickling contexts speak on in their next utterances."""
    async def hog(running, stop: asyncio.Event) -> list[dict]:
        async with connect(running.ws) as ws:
            assert json.loads(await ws.recv())["type"] == "session.started"
            await ws.send(json.dumps({"type": "session.start", "text": {"buffering": "none"}}))
            for context_id in ("h0", "h1"):  # both slots of the engine
                await ws.send(json.dumps({"type": "text.append", "context_id": context_id, "text": "Hi there"}))
            while not stop.is_set():
                await asyncio.sleep(1.0)
                for context_id in ("h0", "h1"):
                    await ws.send(json.dumps({"type": "text.append", "context_id": context_id, "text": " a"}))
            for context_id in ("h0", "h1"):
                await ws.send(json.dumps({"type": "context.end", "context_id": context_id}))
            events: list[dict] = []
            while sum(e.get("type") == "context.done" for e in events) < 2:
                if isinstance(message := await asyncio.wait_for(ws.recv(), 60), str):
                    events.append(json.loads(message))
            return events

    async def go(running) -> tuple[float, list[dict]]:
        stop = asyncio.Event()
        hogging = asyncio.create_task(hog(running, stop))
        deadline = time.monotonic() + 60
        while running.metric("voxgate_engine_requests_active") < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.0)  # both slots held, text trickling
        async with connect(running.ws) as ws:
            assert json.loads(await ws.recv())["type"] == "session.started"
            started = time.monotonic()
            await ws.send(json.dumps({"type": "text.append", "context_id": "v", "text": "Hello there."}))
            await ws.send(json.dumps({"type": "context.end", "context_id": "v"}))
            while isinstance(message := await asyncio.wait_for(ws.recv(), 60), str):
                assert json.loads(message)["type"] != "error", message
            waited = time.monotonic() - started
        stop.set()
        return waited, await hogging

    with running_server(Limits(), max_batch=2, synthetic_frames_per_token=SHORT_SPEECH) as running:
        waited, hog_events = asyncio.run(go(running))
    assert waited < 3 * speech_context.CONTENDED_PAUSE_S + 2.0, waited  # not for as long as the text trickles
    assert not [e for e in hog_events if e["type"] == "error"]


@given(quiet_s=st.floats(0.0, 10.0), late_s=st.floats(0.0, 3.0), played_out=st.booleans())
def test_a_contended_pause_needs_a_quiet_second_a_listener_run_dry_and_a_timer_on_time(quiet_s, late_s, played_out):
    """The contended pause cuts a context's speech in two (its next utterance waits for a slot), so a context with
    audio still to play, or one whose text may wait unread behind a busy loop (its timer came late), keeps its
    utterance; the trickling hog of the test above has played out its few frames, and is cut."""
    due = speech_context.contended_pause_due(quiet_s, late_s, played_out)
    assert due == (quiet_s >= speech_context.CONTENDED_PAUSE_S and played_out
                   and late_s <= speech_context.LATE_TIMER_S)


def test_text_that_stops_behind_an_utterance_still_speaking_gives_its_slot_back_too(monkeypatch):
    """The pause came while the next utterance was still queued behind a long one (not started: no slot yet); when
    it started later, nothing closed it and it held its slot for good (a review's finding)."""
    monkeypatch.setattr(speech_context, "TEXT_PAUSE_S", 0.3)
    long_text = " ".join(["word"] * 60) + "."

    async def go(running):
        async with connect(running.ws) as ws:
            assert json.loads(await ws.recv())["type"] == "session.started"
            await ws.send(json.dumps({"type": "session.start", "text": {"buffering": "none"}}))
            await ws.send(json.dumps({"type": "text.append", "context_id": "c", "text": long_text, "flush": True}))
            await ws.send(json.dumps({"type": "text.append", "context_id": "c", "text": "And then"}))
            deadline = time.monotonic() + 120
            while running.metric("voxgate_engine_requests_active") == 0:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            while running.metric("voxgate_engine_requests_active") != 0:  # both utterances end, no text coming
                assert time.monotonic() < deadline, "the utterance that started after the pause kept its slot"
                await ws.send(json.dumps({"type": "keepalive"}))
                await asyncio.sleep(0.1)
            await ws.send(json.dumps({"type": "context.end", "context_id": "c"}))
            return await context_done(ws, "c")

    with running_server(Limits(), synthetic_frames_per_token=SHORT_SPEECH) as running:
        events = asyncio.run(go(running))
    assert not [e for e in events if e["type"] == "error"] and events[-1]["audio_ms"] > 0


def test_the_queue_depth_gauge_drops_when_queued_requests_are_cancelled():
    """voxgate_engine_queue_depth is reported by the engine's steps; requests cancelled while they wait for a slot
    leave it at once, also when no step follows (it stayed at its last value while the engine idled)."""
    with running_server(max_batch=1) as server:
        async def go():
            async with connect(server.ws) as ws:
                assert json.loads(await ws.recv())["type"] == "session.started"
                for context_id in ("a", "b", "c"):
                    await ws.send(json.dumps({"type": "text.append", "context_id": context_id,
                                              "text": "A sentence long enough to keep the only slot busy. " * 6}))
                    await ws.send(json.dumps({"type": "context.end", "context_id": context_id}))
                deadline = time.monotonic() + 30
                while server.metric("voxgate_engine_queue_depth") < 2:  # one runs, two wait
                    assert time.monotonic() < deadline, "the two waiting requests never showed in the gauge"
                    await asyncio.sleep(0.05)
                await ws.send(json.dumps({"type": "context.cancel", "context_id": "*"}))
                deadline = time.monotonic() + 5
                while server.metric("voxgate_engine_queue_depth") != 0:
                    assert time.monotonic() < deadline, "the gauge kept the cancelled requests"
                    await asyncio.sleep(0.05)
        asyncio.run(go())


def test_one_session_leaves_slots_to_others_and_sessions_take_turns():
    """Hostile tries: one session held every slot with long contexts and queued more, and another session's context
    waited behind all of them (37-61 s on the CPU's 8 slots), then for one of them to end (36 s). A session now
    holds at most the slots less a quarter (at least one): another session's context starts at once. Once those are
    taken too, sessions take turns: the first slot that frees goes to a session that runs nothing, before the
    holder's older queued contexts."""
    long_text = "word " * 200  # one utterance that runs for many steps: each context keeps its slot
    with running_server(max_batch=4) as server:
        async def speak(ws, name: str) -> None:
            await ws.send(json.dumps({"type": "text.append", "context_id": name, "text": long_text}))
            await ws.send(json.dumps({"type": "context.end", "context_id": name}))

        async def first_audio(ws) -> None:
            while not isinstance(message := await asyncio.wait_for(ws.recv(), 30), bytes):
                assert json.loads(message)["type"] != "error", message

        async def go() -> None:
            async with connect(server.ws) as hog, connect(server.ws) as other, connect(server.ws) as third:
                reading = asyncio.create_task(_read_all(hog))
                for name in ("a1", "a2", "a3", "a4", "a5"):
                    await speak(hog, name)
                await _until(lambda: server.metric("voxgate_engine_queue_depth") == 2)  # a4 and a5 wait
                await speak(other, "b")
                await first_audio(other)  # the spare slot: no context of the hog's had to end
                assert server.metric("voxgate_engine_queue_depth") == 2
                await speak(third, "c")
                await _until(lambda: server.metric("voxgate_engine_queue_depth") == 3)
                await hog.send(json.dumps({"type": "context.cancel", "context_id": "a1"}))  # one slot frees
                await first_audio(third)
                assert server.metric("voxgate_engine_queue_depth") == 2  # a4 and a5 still wait
                reading.cancel()
        asyncio.run(go())


def test_two_sessions_that_fill_their_slots_still_leave_one_to_a_newcomer():
    """A hostile try: two sessions (of one API key) with 8 long contexts each held all 8 slots, and a third client's
    first audio waited 35 s for one of them to end. Past its first, each session's context leaves the reserve
    (a sixteenth of them, at least one) to clients that run nothing: the third starts at once, while every hog
    context still runs or waits."""
    long_text = "word " * 200
    with running_server(max_batch=8) as server:
        async def go() -> None:
            async with connect(server.ws) as one, connect(server.ws) as two, connect(server.ws) as third:
                readers = [asyncio.create_task(_read_all(hog)) for hog in (one, two)]
                for hog, prefix in ((one, "a"), (two, "b")):
                    for index in range(8):
                        await hog.send(json.dumps({"type": "text.append", "context_id": f"{prefix}{index}",
                                                   "text": long_text}))
                        await hog.send(json.dumps({"type": "context.end", "context_id": f"{prefix}{index}"}))
                await _until(lambda: server.metric("voxgate_engine_requests_active") == 16  # running or waiting
                             and server.metric("voxgate_engine_queue_depth") >= 9)
                await third.send(json.dumps({"type": "text.append", "context_id": "c", "text": "Hello there."}))
                await third.send(json.dumps({"type": "context.end", "context_id": "c"}))
                while not isinstance(message := await asyncio.wait_for(third.recv(), 30), bytes):
                    assert json.loads(message)["type"] != "error", message
                assert server.metric("voxgate_engine_requests_active") == 17  # no hog context had to end
                for reader in readers:
                    reader.cancel()
        asyncio.run(go())


async def _read_all(ws) -> None:
    while True:
        await ws.recv()


async def _until(condition, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)
