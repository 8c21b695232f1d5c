"""Compare scheduling policies on the simulator (engine/core/simulator.py): Poisson load, a GPU cost model, the real
scheduler. Prints one markdown table row per (text mode, rate, setup).

    python scripts/simulate_scheduler.py --rates 40,60,80 --slots 512 --max-step-batch 256
    python scripts/simulate_scheduler.py --compare smoothness --rates 20,40,60,80 --duration 30
    python scripts/simulate_scheduler.py --compare smoothness --burst 256 --slots 256

`--burst N`: instead of Poisson arrivals, N voice-chat sessions opened in the same instant (LLM-streamed text only).

`--compare policies` (the default): step selection with frames out as they are made. `--compare smoothness`: the
chunk schedule {fixed, lead} x admission {all, protect}, with audio out per chunk and decoding paid per chunk.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core.scheduler import Scheduler  # noqa: E402
from engine.core.simulator import (  # noqa: E402
    Arrival, CostModel, burst_workload, poisson_workload, simulate, summarize)

HEADER = ("| text | rate | scheduling | requests | TTFA p50 / p95 / p99 | never underrun | audio s/s |\n"
          "|---|---|---|---|---|---|---|")


def row(streaming: bool, rate: float, label: str, result: dict) -> str:
    return (f"| {'LLM-streamed' if streaming else 'whole'} | {rate:g}/s | {label} | {result['requests']} | "
            f"{result['ttfa_ms_p50']:.0f} / {result['ttfa_ms_p95']:.0f} / {result['ttfa_ms_p99']:.0f} ms | "
            f"{result['never_underrun']:.1%} | {result['audio_s_per_s']:.0f} |")


def policies(arrivals: list[Arrival], args: argparse.Namespace) -> list[tuple[str, dict]]:
    """Step selection: every request every step, fcfs and deadline under a step limit."""
    setups = [("fcfs", None, "continuous batching: every request every step"),
              ("fcfs", args.max_step_batch, f"fcfs, at most {args.max_step_batch} per step"),
              ("deadline", args.max_step_batch, f"deadline, at most {args.max_step_batch} per step")]
    return [(label, summarize(simulate(arrivals, Scheduler(args.slots, policy, limit), CostModel())))
            for policy, limit, label in setups]


def smoothness(arrivals: list[Arrival], args: argparse.Namespace) -> list[tuple[str, dict]]:
    """Chunk schedule x admission, deadline selection under the step limit, audio out per chunk."""
    out = []
    for chunks in ("fixed", "lead"):
        for admission in ("all", "protect"):
            scheduler = Scheduler(args.slots, "deadline", args.max_step_batch, admission=admission)
            requests = simulate(arrivals, scheduler, CostModel(), chunks=chunks, chunk_frames=args.chunk_frames,
                                busy_batch=args.busy_batch)
            out.append((f"chunks {chunks}, admission {admission}", summarize(requests)))
    return out


def one_shot(arrivals: list[Arrival], marked: bool) -> list[Arrival]:
    """The arrivals as one-shot (HTTP) requests when `marked`: the busy start applies to them alone."""
    return [replace(a, interactive=False) for a in arrivals] if marked else arrivals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[40.0, 60.0, 80.0])
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--slots", type=int, default=512)
    parser.add_argument("--max-step-batch", type=int, default=256)
    parser.add_argument("--chunk-frames", type=int, default=4)
    parser.add_argument("--busy-batch", type=int, metavar="N",
                        help="one-shot requests' first chunks of two frames in steps of more (with --one-shot)")
    parser.add_argument("--one-shot", action="store_true",
                        help="the arrivals are one-shot (HTTP) requests, not a conversation's contexts")
    parser.add_argument("--compare", choices=["policies", "smoothness"], default="policies")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--burst", type=int, metavar="N", help="N sessions opened at once instead of Poisson arrivals")
    args = parser.parse_args()
    compare = policies if args.compare == "policies" else smoothness
    print(HEADER)
    if args.burst:
        for label, result in compare(one_shot(burst_workload(args.burst, args.seed), args.one_shot), args):
            print(row(True, 0, f"burst of {args.burst}, {label}", result), flush=True)
        return
    for streaming in (False, True):
        for rate in args.rates:
            arrivals = one_shot(poisson_workload(rate, args.duration, args.seed, streaming_text=streaming),
                                args.one_shot)
            for label, result in compare(arrivals, args):
                print(row(streaming, rate, label, result), flush=True)


if __name__ == "__main__":
    main()
