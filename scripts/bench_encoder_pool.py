"""The encoder pool's round trip on a busy event loop: S streams each encode a chunk of audio (one 80 ms frame of
the model's, four 20 ms Opus packets) again and again, concurrently, while another task holds the loop for `--busy-ms`
every turn, as the gateway's other sessions do in a burst. Each hop between the pipe and the caller waits a turn, so
the round trip counts the turns the pool costs; the loop thread's CPU per call (the busy task's holds taken out)
counts its own work.

    python scripts/bench_encoder_pool.py --streams 64 --workers 2 --duration 10 --busy-ms 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np

from realtime.audio.encoder_pool import EncoderPool
from realtime.audio.formats import AudioFormat

CHUNK = 1920  # one frame of the model: 80 ms at 24 kHz


async def stream(pool: EncoderPool, until: float, rounds: list[float]) -> None:
    encoder = pool.open(AudioFormat())
    samples = (0.1 * np.sin(np.arange(CHUNK) / 7.0)).astype(np.float32)
    while time.perf_counter() < until:
        started = time.perf_counter()
        await encoder.encode(samples)
        rounds.append(time.perf_counter() - started)
    await encoder.finish()


async def busy(until: float, hold_s: float) -> float:
    """Holds the loop for `hold_s` once a turn (a turn's other callbacks: other sessions' work); the CPU it held."""
    held = 0.0
    while time.perf_counter() < until:
        started = time.thread_time()
        end = time.perf_counter() + hold_s
        while time.perf_counter() < end:
            pass
        held += time.thread_time() - started
        await asyncio.sleep(0)
    return held


async def run(args: argparse.Namespace) -> dict:
    pool = EncoderPool(args.workers)
    await pool.start()
    try:
        rounds: list[float] = []
        until = time.perf_counter() + args.duration
        cpu = time.thread_time()
        held, *_ = await asyncio.gather(busy(until, args.busy_ms / 1000),
                                        *(stream(pool, until, rounds) for _ in range(args.streams)))
        cpu = time.thread_time() - cpu - held
    finally:
        await pool.stop()
    ordered = sorted(rounds)
    return {"streams": args.streams, "workers": args.workers, "busy_ms": args.busy_ms, "calls": len(rounds),
            "calls_per_s": round(len(rounds) / args.duration, 1),
            "round_trip_ms": {q: round(1e3 * ordered[min(len(ordered) - 1, int(p * len(ordered)))], 2)
                              for q, p in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))},
            "loop_cpu_us_per_call": round(1e6 * cpu / max(1, len(rounds)), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--busy-ms", type=float, default=2.0, help="the loop held this long once a turn")
    print(json.dumps(asyncio.run(run(parser.parse_args()))))


if __name__ == "__main__":
    main()
