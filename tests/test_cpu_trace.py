"""scripts/device/cpu_trace.py: CPU by process kind, a busy "gateway" (by its command line) and the busy process it
started (its engine, by its parent) each named and counted."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPIN = "import time\nstart = time.time()\nwhile time.time() - start < 3: pass\n"


def test_a_busy_gateway_and_the_process_it_started_are_counted_by_kind():
    starts_one = (f"import subprocess, sys\nchild = subprocess.Popen([sys.executable, '-c', {SPIN!r}])\n"
                  f"{SPIN}child.wait()")
    gateway = subprocess.Popen([sys.executable, "-c", starts_one, "realtime.cli serve"])  # the name is in its argv
    try:
        lines = subprocess.run([sys.executable, "scripts/device/cpu_trace.py", "0.5", "2"], cwd=ROOT, timeout=30,
                               capture_output=True, text=True, check=True).stdout.splitlines()
    finally:
        gateway.kill()
        gateway.wait()
    samples = [json.loads(line) for line in lines]
    assert len(samples) >= 3 and all(sample["busy_cores"] >= 0 for sample in samples)
    assert max(sample.get("gateway", 0) for sample in samples) > 0.3
    assert max(sample.get("engine", 0) for sample in samples) > 0.3
