"""A server told to stop (SIGTERM) while speech requests stream: requests arriving meanwhile get a 503 (a speech
request whose body completes after the stop too, and a lexicon, which needs no model); those still
being made after the grace end properly (an SSE stream with an `overloaded` error event, a raw body with its chunked
end), a client that reads nothing does not hold the stop, and the process ends without a crash in its log."""
from __future__ import annotations

import http.client
import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

from realtime.http_transport import SHUTDOWN_FLUSH_S
from realtime.ws.session import SHUTDOWN_GRACE_S
from tests.server_process import server_process

# ~10 frames a word: ~240 s of audio each, which the tiny model on a CPU makes far slower than the grace
SERVER = ["--synthetic-frames-per-token", "10"]
BODY = {"input": "word " * 300, "response_format": "pcm", "stream": True}


def _post(port: int, body: dict) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", "/v1/audio/speech", json.dumps(body), {"Content-Type": "application/json"})
    return connection.getresponse()


def _body_after_the_stop(port: int, body: dict) -> tuple[socket.socket, bytes]:
    """A request whose headers and all but its body's last byte are sent now (the rest: `finish`)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data[:-1])
    return sock, data[-1:]


def _answer(sock: socket.socket) -> bytes:
    """A response with a Content-Length (a refusal's JSON), read whole."""
    with sock.makefile("rb") as stream:
        head = b"".join(iter(stream.readline, b"\r\n"))
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        return head + b"\r\n" + stream.read(length)


def _events(body: bytes) -> list[dict]:
    return [json.loads(event.removeprefix(b"data: ")) for event in body.split(b"\n\n") if event]


def test_sigterm_ends_streamed_speech_within_the_grace_and_exits_cleanly(tmp_path):
    with server_process(SERVER, tmp_path / "server.log") as server:
        sse = _post(server.port, {**BODY, "stream_format": "sse"})
        raw = _post(server.port, BODY)
        unread = _post(server.port, BODY)  # its client reads the status and nothing more
        assert sse.status == raw.status == unread.status == 200
        late, last_byte = _body_after_the_stop(server.port, BODY)
        with ThreadPoolExecutor(2) as readers:
            sse_body, raw_body = readers.submit(sse.read), readers.submit(raw.read)  # to the chunked end, or raise
            time.sleep(1.0)
            stopped_at = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            while server.get("/ready")[0] == 200:  # until the drain has begun (a loaded machine may take a moment)
                time.sleep(0.05)
            refused = _post(server.port, BODY)
            late.sendall(last_byte)  # past the readiness check before the stop; its speech would start after it
            late_answer = _answer(late)
            lexicon = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            rules = [{"term": "NASA", "replacement": "nassa"}]
            lexicon.request("POST", "/v1/lexicons", json.dumps({"name": "lost", "rules": rules}),
                            {"Content-Type": "application/json"})
            lexicon_answer = lexicon.getresponse()
            events, audio = _events(sse_body.result(60)), raw_body.result(60)
        server.process.wait(60)
        took = time.monotonic() - stopped_at
        log = server.log()
    assert refused.status == 503 and json.loads(refused.read())["error"]["code"] == "overloaded"
    assert late_answer.startswith(b"HTTP/1.1 503") and b'"overloaded"' in late_answer, late_answer[:300]
    assert lexicon_answer.status == 503  # what it stored would be lost with the process
    assert len(events) > 1 and all(event["type"] == "speech.audio.delta" for event in events[:-1])
    assert events[-1]["type"] == "error" and events[-1]["code"] == "overloaded", events[-1]
    assert len(audio) > 0 and len(audio) % 2 == 0
    # uvicorn re-raises the signal once it has shut down: killed by it, after "Application shutdown complete"
    assert server.process.returncode == -signal.SIGTERM and "Application shutdown complete" in log, log[-3000:]
    assert took < SHUTDOWN_GRACE_S + SHUTDOWN_FLUSH_S + 10, took  # uvicorn's own wait alone would be 10 s more
    for crash in ("Traceback", "Exception in ASGI application", "timeout graceful shutdown exceeded"):
        assert crash not in log, log[-3000:]
