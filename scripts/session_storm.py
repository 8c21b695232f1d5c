"""A storm of sessions: N voxgate.v1 sessions opened at the same instant (a server's start, a reconnect after a network
blip), each sending `session.start` and waiting for `session.started`, held a few seconds, then closed. Prints one
JSON line: when the sockets opened and when the sessions started, seconds after the first connect (p50 / p95 /
max), and the server's garbage collections meanwhile (from its /metrics: count and seconds by generation). The
gateway does all of it on its one event loop, so the last start is how long every stream on it waited.

    python scripts/session_storm.py --url ws://127.0.0.1:8000/v1/tts/stream --sessions 512
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
import urllib.request
from urllib.parse import urlsplit

from websockets.asyncio.client import connect


async def one_session(url: str, encoding: str, hold_s: float, began: float, opened: list[float],
                      started: list[float]) -> None:
    async with connect(url, max_size=None) as ws:
        opened.append(time.perf_counter() - began)
        await ws.send(json.dumps({"type": "session.start", "audio": {"encoding": encoding}}))
        while json.loads(await ws.recv())["type"] != "session.started":
            pass
        started.append(time.perf_counter() - began)
        await asyncio.sleep(hold_s)


def spread(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {"p50": round(ordered[len(ordered) // 2], 3), "p95": round(ordered[int(len(ordered) * 0.95)], 3),
            "max": round(ordered[-1], 3)}


_GC_SERIES = re.compile(r'^voxgate_gc_pause_seconds_(count|sum)\{generation="(\d)"\} (\S+)$', re.M)


def collections(url: str) -> dict[str, dict[str, float]]:
    """The server's garbage collections so far ({generation: {count, seconds}}), from the /metrics beside `url`;
    none where it cannot be read."""
    parts = urlsplit(url)
    scheme = "https" if parts.scheme == "wss" else "http"
    try:
        with urllib.request.urlopen(f"{scheme}://{parts.netloc}/metrics", timeout=30) as response:
            text = response.read().decode()
    except OSError:  # urllib's errors (a refusal, a server without metrics) included
        return {}
    out: dict[str, dict[str, float]] = {}
    for kind, generation, value in _GC_SERIES.findall(text):
        out.setdefault(generation, {})["count" if kind == "count" else "seconds"] = float(value)
    return out


def difference(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]]) -> dict[str, dict]:
    zero = {"count": 0.0, "seconds": 0.0}
    return {generation: {"count": int(now["count"] - before.get(generation, zero)["count"]),
                         "seconds": round(now["seconds"] - before.get(generation, zero)["seconds"], 4)}
            for generation, now in sorted(after.items())}


async def storm(url: str, sessions: int, encoding: str, hold_s: float) -> dict:
    opened: list[float] = []
    started: list[float] = []
    before = collections(url)
    began = time.perf_counter()
    await asyncio.gather(*(one_session(url, encoding, hold_s, began, opened, started) for _ in range(sessions)))
    return {"sessions": sessions, "encoding": encoding, "opened_s": spread(opened), "started_s": spread(started),
            "gc_pauses": difference(collections(url), before)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8000/v1/tts/stream", help="with ?token=KEY when keys are set")
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--encoding", default="opus")
    parser.add_argument("--hold", type=float, default=3.0, help="seconds each session stays open once started")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(storm(args.url, args.sessions, args.encoding, args.hold))))


if __name__ == "__main__":
    main()
