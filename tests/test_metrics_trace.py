"""scripts/device/metrics_trace.py: the engine's time series from a server's /metrics, checked on the gateway's own
registry and against a real server."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

from realtime.metrics import Metrics
from scripts.device.metrics_trace import line, samples
from tests.server_process import ROOT, server_process


def snapshot(metrics: Metrics) -> dict[str, float]:
    return samples(metrics.render()[0].decode())


def test_an_interval_gets_its_own_steps_their_mean_and_longest_bucket():
    metrics = Metrics()
    start = snapshot(metrics)
    metrics.on_step(0.005, 10)
    metrics.on_step(0.07, 200)
    metrics.engine_queue_depth.set(3)
    busy = snapshot(metrics)
    record = line(start, busy)
    assert record["steps"] == 2 and record["step_ms"] == 37.5 and record["batch"] == 105.0
    assert record["longest_step_le_s"] == "0.08" and record["waiting"] == 3.0  # 70 ms falls in (0.05, 0.08]
    metrics.on_step(0.003, 1)
    assert line(busy, snapshot(metrics)) | {"t": 0} == {
        "t": 0, "steps": 1, "step_ms": 3.0, "longest_step_le_s": "0.004", "batch": 1.0, "waiting": 3.0,
        "requests": 0.0, "contexts": 0.0}
    quiet = snapshot(metrics)
    assert line(quiet, quiet)["steps"] == 0 and line(quiet, quiet)["step_ms"] is None


def test_a_trace_of_a_real_server_counts_the_steps_of_a_request(tmp_path):
    with server_process(["--synthetic-frames-per-token", "2"], tmp_path / "server.log") as server:
        before = server.metric("voxgate_engine_step_seconds_count")
        trace = subprocess.Popen([sys.executable, "scripts/device/metrics_trace.py", server.http, "0.1"], cwd=ROOT,
                                 stdout=subprocess.PIPE, text=True)
        time.sleep(1.0)  # the trace's first scrape is its baseline
        body = json.dumps({"model": "tts-1", "input": "Hello there.", "response_format": "pcm"}).encode()
        request = urllib.request.Request(server.http + "/v1/audio/speech", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            assert response.status == 200 and response.read()
        time.sleep(0.5)
        steps = server.metric("voxgate_engine_step_seconds_count") - before
        trace.terminate()
        out, _ = trace.communicate(timeout=30)
        server.assert_alive()
    records = [json.loads(text) for text in out.splitlines()]
    assert steps > 0 and sum(r["steps"] for r in records) == steps
    stepped = [r for r in records if r["steps"]]
    assert all(r["step_ms"] > 0 and 0.0 <= r["batch"] <= 1.0 and r["longest_step_le_s"] for r in stepped)
    assert any(r["batch"] == 1.0 for r in stepped)  # one request: a step frames it alone (a prefill's step may not)
