"""scripts/bench_ws_send.py: a short real run (uvicorn with the gateway's protocol, a websockets client in a process of
its own) delivers every message and reports the sender's cost per message."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.server_process import ROOT


def test_every_message_arrives_and_the_cost_per_message_is_reported():
    run = subprocess.run([sys.executable, "scripts/bench_ws_send.py", "--messages", "300", "--bytes", "20"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["messages"] == report["received"] == 300 and report["bytes"] == 20
    assert 0 < report["cpu_us_per_message"] <= report["wall_us_per_message"] * 1.5
