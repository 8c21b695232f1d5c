"""Sessions come and go by the hundred, half of them dropped mid-stream without a close frame: afterwards nothing is
left counted (sessions, contexts, engine requests) and the server process has not grown."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.server_process import server_process

WARM_UP, CHURN, AT_ONCE = 100, 300, 8
GAUGES = ("voxgate_sessions_active", "voxgate_contexts_active", "voxgate_engine_requests_active")
MAX_GROWTH_BYTES = 20 * 1024 * 1024


async def _one_session(url: str, drop: bool) -> None:
    """Speak a short context; a dropped session vanishes at its first audio frame (no close frame: an abort)."""
    with contextlib.suppress(ConnectionClosed):
        async with connect(url) as ws:
            await ws.send(json.dumps({"type": "text.append", "context_id": "c", "text": "Hello there, friend."}))
            await ws.send(json.dumps({"type": "context.end", "context_id": "c"}))
            while True:
                message = await asyncio.wait_for(ws.recv(), 60)
                if isinstance(message, bytes) and drop:
                    ws.transport.abort()
                    return
                if isinstance(message, str) and json.loads(message)["type"] == "context.done":
                    return


async def _sessions(url: str, count: int) -> None:
    limit = asyncio.Semaphore(AT_ONCE)

    async def one(number: int) -> None:
        async with limit:
            await _one_session(url, drop=number % 2 == 1)

    await asyncio.gather(*(one(number) for number in range(count)))


def _settled(server, deadline_s: float = 20.0) -> dict[str, float]:
    """The gauges once they are all 0, or as they are at the deadline."""
    deadline = time.monotonic() + deadline_s
    while True:
        values = {name: server.metric(name) for name in GAUGES}
        if not any(values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


def test_churn_leaves_no_session_context_or_request_behind_and_no_growth(tmp_path):
    with server_process(["--max-sessions", "64"], tmp_path / "server.log") as server:
        asyncio.run(_sessions(server.ws, WARM_UP))
        assert _settled(server) == dict.fromkeys(GAUGES, 0.0)
        before = server.rss_bytes()
        asyncio.run(_sessions(server.ws, CHURN))
        assert _settled(server) == dict.fromkeys(GAUGES, 0.0)
        grown = server.rss_bytes() - before
        assert grown < MAX_GROWTH_BYTES, f"RSS grew by {grown / 2**20:.1f} MiB over {CHURN} sessions"
        server.assert_alive()
