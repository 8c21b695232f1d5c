"""scripts/session_storm.py against a real server: every session of the storm starts, and the report's times are
ordered (a socket opens before its session starts)."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.gateway_server import running_server
from tests.server_process import ROOT


def test_every_session_of_a_storm_starts_and_is_timed():
    with running_server() as server:
        run = subprocess.run([sys.executable, "scripts/session_storm.py", "--url", server.ws, "--sessions", "24",
                              "--hold", "0.2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["sessions"] == 24 and report["encoding"] == "opus"
    opened, started = report["opened_s"], report["started_s"]
    assert 0 < opened["p50"] <= opened["p95"] <= opened["max"] <= started["max"]
    assert started["p50"] <= started["p95"] <= started["max"] < 60
    for generation, pauses in report["gc_pauses"].items():  # the server's own collections meanwhile, if any
        assert generation in "012" and pauses["count"] >= 0 and pauses["seconds"] >= 0
