"""Compare scheduling policies on the simulator (engine/core/simulator.py): Poisson load, a GPU cost model, the real
scheduler. Prints one markdown table row per (text mode, rate, policy).

    python scripts/simulate_scheduler.py --rates 40,60,80 --slots 512 --max-step-batch 256
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core.scheduler import Scheduler  # noqa: E402
from engine.core.simulator import CostModel, poisson_workload, simulate, summarize  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[40.0, 60.0, 80.0])
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--slots", type=int, default=512)
    parser.add_argument("--max-step-batch", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    setups = [("fcfs", None, "continuous batching: every request every step"),
              ("fcfs", args.max_step_batch, f"fcfs, at most {args.max_step_batch} per step"),
              ("deadline", args.max_step_batch, f"deadline, at most {args.max_step_batch} per step")]
    print("| text | rate | scheduling | requests | TTFA p50 / p95 / p99 | never underrun |")
    print("|---|---|---|---|---|---|")
    for streaming in (False, True):
        for rate in args.rates:
            arrivals = poisson_workload(rate, args.duration, args.seed, streaming_text=streaming)
            for policy, limit, label in setups:
                result = summarize(simulate(arrivals, Scheduler(args.slots, policy, limit), CostModel()))
                print(f"| {'LLM-streamed' if streaming else 'whole'} | {rate:g}/s | {label} | {result['requests']} | "
                      f"{result['ttfa_ms_p50']:.0f} / {result['ttfa_ms_p95']:.0f} / {result['ttfa_ms_p99']:.0f} ms | "
                      f"{result['never_underrun']:.1%} |")


if __name__ == "__main__":
    main()
