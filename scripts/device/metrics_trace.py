"""A time series of a running server's engine, from its /metrics: every INTERVAL seconds one JSON line with the wall
time (Unix seconds, to line it up with a load generator's records), the steps since the line before, their mean and
longest bucket, their mean batch, and the gauges (requests waiting for a slot, engine requests, open contexts).
Where an end-of-run histogram mixes a burst with the steady state, this says when the steps grew long.

`python3 scripts/device/metrics_trace.py http://127.0.0.1:8000 [INTERVAL_S [DURATION_S]] > trace.jsonl`
"""
from __future__ import annotations

import json
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

STEP = "voxgate_engine_step_seconds"
BATCH = "voxgate_engine_step_batch"
GAUGES = {"voxgate_engine_queue_depth": "waiting", "voxgate_engine_requests_active": "requests",
          "voxgate_contexts_active": "contexts"}


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return samples(response.read().decode())


def samples(text: str) -> dict[str, float]:
    """An exposition's samples by name (a histogram's buckets as NAME_bucket:LE)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + (f":{sample.labels['le']}" if "le" in sample.labels else "")
            values[key] = sample.value
    return values


def longest_bucket(before: dict[str, float], now: dict[str, float]) -> str | None:
    """The upper bound of the highest step-time bucket that gained a step since `before` ('+Inf' past the last)."""
    bounds = sorted((key.split(":", 1)[1] for key in now if key.startswith(STEP + "_bucket:")),
                    key=lambda le: float(le))
    below = 0.0
    longest = None
    for le in bounds:
        key = f"{STEP}_bucket:{le}"
        gained = now[key] - before.get(key, 0.0)
        if gained > below:
            longest = le
        below = gained
    return longest


def line(before: dict[str, float], now: dict[str, float]) -> dict[str, object]:
    steps = now.get(STEP + "_count", 0.0) - before.get(STEP + "_count", 0.0)
    seconds = now.get(STEP + "_sum", 0.0) - before.get(STEP + "_sum", 0.0)
    rows = now.get(BATCH + "_sum", 0.0) - before.get(BATCH + "_sum", 0.0)
    record: dict[str, object] = {
        "t": round(time.time(), 3), "steps": int(steps),
        "step_ms": round(1000 * seconds / steps, 2) if steps else None,
        "longest_step_le_s": longest_bucket(before, now), "batch": round(rows / steps, 1) if steps else None}
    record.update({short: now.get(name) for name, short in GAUGES.items()})
    return record


def main() -> int:
    url = sys.argv[1].rstrip("/") + "/metrics"
    interval = float(sys.argv[2]) if len(sys.argv) > 2 else 0.25
    end = time.monotonic() + (float(sys.argv[3]) if len(sys.argv) > 3 else float("inf"))
    before = scrape(url)
    while time.monotonic() < end:
        time.sleep(interval)
        try:
            now = scrape(url)
        except OSError:  # the server ended
            return 0
        print(json.dumps(line(before, now)), flush=True)
        before = now
    return 0


if __name__ == "__main__":
    sys.exit(main())
