"""A real voxgate server (uvicorn, the embedded tiny model on the CPU) on a free port, in a thread of the test
process, for the gateway, client and bridge tests."""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn

from realtime.gateway import GatewayOptions, Limits
from realtime.server import build_server


@dataclass
class RunningServer:
    http: str  # http://127.0.0.1:PORT
    ws: str  # ws://127.0.0.1:PORT/v1/tts/stream
    server: object

    @property
    def gateway(self):
        return self.server.gateway

    def get(self, path: str, token: str | None = None) -> tuple[int, bytes]:
        request = urllib.request.Request(self.http + path)
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as failure:
            return failure.code, failure.read()

    def post(self, path: str, body: dict | bytes, token: str | None = None) -> tuple[int, dict, bytes]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.http + path, data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as failure:
            return failure.code, dict(failure.headers), failure.read()

    def metric(self, name: str) -> float:
        """The value of an unlabelled metric from /metrics."""
        _, body = self.get("/metrics")
        for line in body.decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)


def serve_in_thread(server: uvicorn.Server, timeout_s: float = 120) -> tuple[threading.Thread, int]:
    """Start a uvicorn server (bound to port 0) in a daemon thread; returns the thread and the port it got."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return thread, server.servers[0].sockets[0].getsockname()[1]


@contextlib.contextmanager
def running_server(limits: Limits = Limits(), **options) -> Iterator[RunningServer]:
    server = build_server(GatewayOptions(limits=limits, **options), port=0, log_level="warning")
    deadline = time.monotonic() + 120
    thread, port = serve_in_thread(server)
    running = RunningServer(f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/v1/tts/stream", server)
    while running.get("/ready")[0] != 200:
        if time.monotonic() > deadline or server.gateway.state == "failed":
            raise RuntimeError(f"the test server never became ready: {server.gateway.readiness()}")
        time.sleep(0.05)
    try:
        yield running
    finally:
        server.should_exit = True
        thread.join(timeout=30)


async def events_until_closed(ws, timeout_s: float = 30) -> tuple[list[dict], int | None]:
    """Every JSON event a raw client socket receives until the server closes it, and the close code."""
    from websockets.exceptions import ConnectionClosed

    events = []
    try:
        while True:
            message = await asyncio.wait_for(ws.recv(), timeout_s)
            if isinstance(message, str):
                events.append(json.loads(message))
    except ConnectionClosed as closed:
        return events, closed.rcvd.code if closed.rcvd else None


# random weights never end an utterance by themselves: each is held to this many frames per text token (2-4 is real
# speech), so tests wait for short speech instead of the runaway guard
SHORT_SPEECH = 2.0


def short_speech_server() -> contextlib.AbstractContextManager[RunningServer]:
    """A real server with short utterances and a 1 s idle timeout: the framework plugins' tests (keepalives)."""
    return running_server(Limits(idle_timeout_s=1.0), synthetic_frames_per_token=SHORT_SPEECH)
