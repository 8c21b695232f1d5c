"""scripts/bench_text.py: a short real run reports a CPU time for every input family it names."""
from __future__ import annotations

import json
import subprocess
import sys

from scripts.bench_text import CLEANUP_TEXTS, LEXICONS, PLANNER_TEXTS, QUERIES, TEXTS
from tests.server_process import ROOT


def test_a_short_run_reports_every_family():
    run = subprocess.run([sys.executable, "scripts/bench_text.py", "--chars", "400", "--repeats", "1"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    cpu_ms = json.loads(run.stdout)["cpu_ms"]
    assert len(cpu_ms) == len(LEXICONS) * len(TEXTS) + 1 + len(PLANNER_TEXTS) + len(CLEANUP_TEXTS) + len(QUERIES)
    assert all(value >= 0 for value in cpu_ms.values())
