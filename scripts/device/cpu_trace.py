"""CPU by process kind on this machine: every INTERVAL seconds one JSON line with the time (`time.monotonic()`, the
clock of `burst_trace`), the machine's busy cores and each kind's cores over the interval: the gateway (`realtime.cli
serve`), its engine process (a process the gateway started), its audio encoders (`realtime.audio.encoder_worker`),
the load generators (`bench_gateway.py`, `tts_bench` and their processes) and the rest. Where a run's latency grows,
this says whether one process was bound by its core (a gateway at 1.0: its one event loop is full) or the host was
(docs/benchmarks.md, "Where the rest of the burst goes").

`python3 scripts/device/cpu_trace.py [INTERVAL_S [DURATION_S]] > cpu.jsonl`
"""
from __future__ import annotations

import json
import os
import sys
import time

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
KINDS = (("realtime.audio.encoder_worker", "encoders"), ("realtime.cli serve", "gateway"),
         ("bench_gateway", "load"), ("tts_bench", "load"))
INHERITED = {"gateway": "engine", "load": "load", "engine": "engine"}  # a child's kind, by its parent's


def process_kind(pid: int, kinds: dict[int, str]) -> str:
    """By the command line; else by the parent (the engine process and a load generator's workers are spawned)."""
    try:
        command = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        parent = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return "other"
    for needle, kind in KINDS:
        if needle in command:
            return kind
    if parent not in kinds and parent > 1:
        kinds[parent] = process_kind(parent, kinds)
    return INHERITED.get(kinds.get(parent, "other"), "other")


def cpu_ticks(pid: int) -> int | None:
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime + stime


def machine_ticks() -> tuple[int, int]:
    """All ticks and idle ticks (idle + iowait) since boot."""
    values = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    return sum(values), values[3] + values[4]


def main() -> None:
    interval = float(sys.argv[1]) if len(sys.argv) > 1 else 0.25
    end = time.monotonic() + (float(sys.argv[2]) if len(sys.argv) > 2 else float("inf"))
    kinds: dict[int, str] = {}
    before: dict[int, int] = {}
    total_before, idle_before = machine_ticks()
    while time.monotonic() < end:
        time.sleep(interval)
        cores: dict[str, float] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            ticks = cpu_ticks(pid)
            if ticks is None:
                continue
            if pid not in kinds:
                kinds[pid] = process_kind(pid, kinds)
            if pid in before:
                kind = kinds[pid]
                cores[kind] = cores.get(kind, 0.0) + (ticks - before[pid]) / TICKS_PER_S / interval
            before[pid] = ticks
        total, idle = machine_ticks()
        busy = (os.cpu_count() or 1) * (1 - (idle - idle_before) / max(1, total - total_before))
        total_before, idle_before = total, idle
        print(json.dumps({"t": round(time.monotonic(), 3), "busy_cores": round(busy, 2),
                          **{kind: round(value, 2) for kind, value in sorted(cores.items()) if value >= 0.01}}),
              flush=True)


if __name__ == "__main__":
    main()
