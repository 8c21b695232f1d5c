"""Reads a `sitecustomize.py` trace (a folder of trace-PID.jsonl) and prints where first audio spent its time: each
leg from a context's text to its first audio sent, across the gateway and the engine process (p50 / p95 / max over
the requests), the engine's steps of 100 rows or more (mean ms in each part), and admission per request.

`python3 scripts/device/burst_trace/burst_report.py TRACE_DIR [TRACE_DIR ...]`
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

LEGS = [("since", "gw_submit", "text speaking -> submit"), ("gw_submit", "en_cmd", "submit -> engine has it"),
        ("en_cmd", "en_pub", "engine has it -> first audio out"),
        ("en_pub", "gw_read", "first audio out -> read by the gateway"),
        ("gw_read", "gw_dispatch", "read -> on the event loop"), ("gw_submit", "gw_dispatch", "submit -> on the loop"),
        ("gw_dispatch", "gw_sent", "on the loop -> sent"),
        ("gw_dispatch", "gw_taken", "  on the loop -> taken by its context"),
        ("gw_taken", "gw_encoded", "  taken -> encoded"), ("gw_encoded", "gw_sent", "  encoded -> sent")]
PARTS = ("wall", "admit", "frames", "host", "post", "queue", "collect", "publish")


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def report(directory: Path) -> None:
    lines = [json.loads(line) for path in sorted(directory.glob("trace-*.jsonl")) for line in path.open()]
    stamps: dict[int, dict[str, float]] = {}
    for line in lines:
        if line.get("rid") is not None:
            stamps.setdefault(line["rid"], {})[line["k"]] = line["t"]
            if "since" in line:
                stamps[line["rid"]]["since"] = line["since"]
    print(f"== {directory}")
    ttfa = [1e3 * (line["t"] - line["since"]) for line in lines if line["k"] == "gw_sent"]
    rows = [("server TTFA (text speaking -> first audio sent)", ttfa)]
    for start, end, name in LEGS:
        rows.append((name, [1e3 * (s[end] - s[start]) for s in stamps.values() if start in s and end in s]))
    for name, values in rows:
        if values:
            print(f"  {name:48s} n={len(values):4d} p50 {nearest_rank(values, 50):6.1f}  p95 "
                  f"{nearest_rank(values, 95):6.1f}  max {max(values):6.1f} ms")
    steps = [line for line in lines if line["k"] == "en_step"]
    busy = [s for s in steps if s["batch"] >= 100]
    if busy:
        means = "  ".join(f"{part} {1e3 * statistics.mean(s.get(part, 0.0) for s in busy):.2f}" for part in PARTS)
        print(f"  steps of >= 100 rows ({len(busy)}), mean ms: {means}")
    admitting = [s for s in steps if s.get("ids")]
    admitted = sum(len(s["ids"]) for s in admitting)
    if admitted:
        print(f"  admission: {1e3 * sum(s['admit'] for s in admitting) / admitted:.2f} ms a request ({admitted})")


if __name__ == "__main__":
    for folder in sys.argv[1:]:
        report(Path(folder))
