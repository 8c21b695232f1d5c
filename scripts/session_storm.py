"""A storm of sessions: N voxgate.v1 sessions opened at the same instant (a server's start, a reconnect after a network
blip), each sending `session.start` and waiting for `session.started`, held a few seconds, then closed. Prints one
JSON line: when the sockets opened and when the sessions started, seconds after the first connect (p50 / p95 /
max). The gateway does all of it on its one event loop, so the last start is how long every stream on it waited.

    python scripts/session_storm.py --url ws://127.0.0.1:8000/v1/tts/stream --sessions 512
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

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


async def storm(url: str, sessions: int, encoding: str, hold_s: float) -> dict:
    opened: list[float] = []
    started: list[float] = []
    began = time.perf_counter()
    await asyncio.gather(*(one_session(url, encoding, hold_s, began, opened, started) for _ in range(sessions)))
    return {"sessions": sessions, "encoding": encoding, "opened_s": spread(opened), "started_s": spread(started)}


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
