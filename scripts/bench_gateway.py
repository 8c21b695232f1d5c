"""Load generator for a voxgate server, end to end through the socket: N concurrent sessions, each speaking contexts
one after another whose text arrives like an LLM's answer (first token after 100-300 ms, then LOW-HIGH tokens/s in
pieces of 1-4 words), for a fixed duration. Prints one JSON report: client-side TTFA (from the first append), the
server's own `ttfa_ms`, the share of contexts that never underran in a simulated player, and errors by code.

`--serve` starts a server in this process (the embedded tiny model unless `--model`); its event loop runs in a
thread beside the load generator's, so on a small CPU the two compete: use a separate server for real numbers.
    python scripts/bench_gateway.py --serve --sessions 4 --duration 20
    python scripts/bench_gateway.py --url ws://HOST:8000/v1/tts/stream --api-key KEY --sessions 40 --token-rate 5-10
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from websockets.exceptions import ConnectionClosed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core.simulator import llm_token_times  # noqa: E402
from voxgate_client.client import ContextResult, ServerError, VoxgateClient  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while music plays softly in the old town hall tonight "
         "and everyone listens to the story about rivers mountains and distant cities").split()


def llm_answer(rng: random.Random, token_rate: tuple[float, float]) -> list[tuple[float, str]]:
    """(seconds after the request, text) of each piece of an answer of 8-40 words, a comma every seven."""
    words = [rng.choice(WORDS) for _ in range(rng.randint(8, 40))]
    tokens = [(" " if i else "") + word + ("," if i % 7 == 6 else "") for i, word in enumerate(words)]
    tokens[-1] = tokens[-1].rstrip(",") + "."
    pieces: list[tuple[float, str]] = []
    for at, token in zip(llm_token_times(rng, 0.0, len(tokens), rng.uniform(*token_rate)), tokens):
        if pieces and pieces[-1][0] == at:  # tokens of one piece share their arrival time
            pieces[-1] = (at, pieces[-1][1] + token)
        else:
            pieces.append((at, token))
    return pieces


async def paced(pieces: list[tuple[float, str]]) -> AsyncIterator[str]:
    start = time.monotonic()
    for at, text in pieces:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        yield text


def never_underran(result: ContextResult, sample_rate: int) -> bool:
    """Playback starts when the first frame arrives; a frame arriving after its playback time is an underrun
    (the empty LAST frame carries no audio and cannot be late)."""
    first = result.arrivals[0]
    return all(at <= first + frame.pts / sample_rate
               for frame, at in zip(result.frames, result.arrivals) if frame.payload)


@dataclass
class Stats:
    contexts: int = 0
    done: int = 0
    audio_s: float = 0.0
    client_ttfa_s: list[float] = field(default_factory=list)
    server_ttfa_ms: list[float] = field(default_factory=list)
    smooth: list[bool] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)

    def add(self, result: ContextResult, sample_rate: int) -> None:
        self.contexts += 1
        self.errors.update(e.get("code", "?") for e in result.errors)
        if result.ttfa_s is not None:
            self.client_ttfa_s.append(result.ttfa_s)
            self.smooth.append(never_underran(result, sample_rate))
        if result.done is not None:
            self.done += 1
            self.audio_s += result.done["audio_ms"] / 1000
            if result.done["metrics"].get("ttfa_ms") is not None:
                self.server_ttfa_ms.append(result.done["metrics"]["ttfa_ms"])


async def count_session_errors(client: VoxgateClient, errors: Counter) -> None:
    """Errors that belong to no running context (a context's own errors are counted from its result)."""
    async for item in client.events():
        if isinstance(item, dict) and item.get("type") == "error":
            errors[item.get("code", "?")] += 1


async def run_session(index: int, args: argparse.Namespace, deadline: float, stats: Stats) -> None:
    rng = random.Random(args.seed * 100_003 + index)
    try:
        async with VoxgateClient.connect(args.url, api_key=args.api_key, encoding=args.encoding) as client:
            watcher = asyncio.create_task(count_session_errors(client, stats.errors))
            if args.buffering != "auto":
                await client.start(text={"buffering": args.buffering})
            rate = client.session["audio"]["sample_rate"]
            count = 0
            while time.monotonic() < deadline and client.close_code is None:
                result = await client.speak(f"s{index}-c{count}", paced(llm_answer(rng, args.token_rate)))
                stats.add(result, rate)
                count += 1
                if any(e.get("fatal") for e in result.errors):  # the server is closing this session
                    break
            await client.close()
            await watcher
    except ServerError as failure:  # refused (overloaded, unauthorized) or closed under us
        stats.errors[failure.code] += 1
    except (ConnectionClosed, OSError) as failure:
        stats.errors[f"connection: {type(failure).__name__}"] += 1


def percentiles(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    array = np.asarray(values) * scale
    return {f"p{q}": round(float(np.percentile(array, q)), 1) for q in (50, 95, 99)}


async def bench(args: argparse.Namespace) -> dict:
    stats = Stats()
    started = time.monotonic()
    deadline = started + args.duration
    await asyncio.gather(*(run_session(i, args, deadline, stats) for i in range(args.sessions)))
    wall = time.monotonic() - started
    return {"url": args.url, "sessions": args.sessions, "duration_s": args.duration, "wall_s": round(wall, 1),
            "encoding": args.encoding, "buffering": args.buffering, "token_rate": list(args.token_rate),
            "contexts": stats.contexts,
            "contexts_done": stats.done, "audio_s": round(stats.audio_s, 1),
            "audio_s_per_wall_s": round(stats.audio_s / wall, 2),
            "ttfa_client_ms": percentiles(stats.client_ttfa_s, 1000.0),
            "ttfa_server_ms": percentiles(stats.server_ttfa_ms),
            "never_underrun": round(sum(stats.smooth) / len(stats.smooth), 3) if stats.smooth else None,
            "errors": dict(stats.errors)}


def start_local_server(args: argparse.Namespace):
    """A server in a thread of this process, on a free port, once its model is warmed up."""
    from realtime.gateway import GatewayOptions, Limits
    from realtime.server import build_server

    options = GatewayOptions(model=args.model, device=args.device, max_batch=args.max_batch,
                             limits=Limits(max_sessions=max(64, args.sessions)))
    server = build_server(options, port=0, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started or not server.gateway.readiness()[0]:
        if not thread.is_alive() or server.gateway.state == "failed":
            raise SystemExit(f"the local server did not start: {server.gateway.readiness()[1]}")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"ws://127.0.0.1:{port}/v1/tts/stream"


def token_rate(text: str) -> tuple[float, float]:
    low, _, high = text.partition("-")
    return float(low), float(high or low)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8000/v1/tts/stream")
    parser.add_argument("--serve", action="store_true", help="start a server in this process (ignores --url)")
    parser.add_argument("--model", type=Path, help="with --serve: checkpoint directory (default: the tiny model)")
    parser.add_argument("--device", default="cpu", help="with --serve")
    parser.add_argument("--max-batch", type=int, help="with --serve: engine slots")
    parser.add_argument("--api-key")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds during which new contexts start")
    parser.add_argument("--token-rate", type=token_rate, default=(20.0, 80.0),
                        help="LLM text rate in tokens/s, a range LOW-HIGH drawn per answer")
    parser.add_argument("--encoding", default="opus", choices=["opus", "pcm_s16le", "mulaw"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--buffering", default="auto", choices=["auto", "none", "sentence"],
                        help="text.buffering of the sessions (none: TTFA from the first token)")
    args = parser.parse_args()
    local = None
    if args.serve:
        local = start_local_server(args)
        args.url = local[2]
    try:
        report = asyncio.run(bench(args))
    finally:
        if local is not None:
            local[0].should_exit = True
            local[1].join(timeout=30)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
