"""scripts/session_storm.py and scripts/abandoned_streams.py against a real server: every session of a storm starts
and is timed, the server's collections are read from its /metrics, and left streams are counted with the server's
memory."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

from tests.gateway_server import running_server
from tests.server_process import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from session_storm import collections  # noqa: E402


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
    assert set(report["gc_pauses"]) <= {"0", "1", "2"}


def test_the_servers_collections_are_read_from_its_metrics():
    """The server here runs in this process: a full collection made here is one of its own, timed in /metrics."""
    with running_server() as server:
        before = collections(server.ws).get("2", {"count": 0.0})["count"]
        gc.collect()
        after = collections(server.ws)["2"]
        assert after["count"] == before + 1 and after["seconds"] > 0


def test_left_streams_are_counted_with_the_servers_memory():
    with running_server() as server:
        run = subprocess.run([sys.executable, "scripts/abandoned_streams.py", "--url", server.http, "--server-pid",
                              str(os.getpid()), "--requests", "8", "--every", "4", "--parallel", "2"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert [line["requests"] for line in lines] == [0, 4, 8]
    assert all(line["rss_mb"] > 0 and line["threads"] > 0 for line in lines)
