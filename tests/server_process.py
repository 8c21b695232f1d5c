"""`voxgate serve` as a process of its own on a free port (the embedded tiny model, CPU), for the tests that need
what only a real process shows: that it stays alive, its log, its memory."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class ServerProcess:
    def __init__(self, port: int, process: subprocess.Popen, log_path: Path) -> None:
        self.port, self.process, self.log_path = port, process, log_path
        self.http = f"http://127.0.0.1:{port}"
        self.ws = f"ws://127.0.0.1:{port}/v1/tts/stream"

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.http + path, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as failure:
            return failure.code, failure.read()
        except OSError:
            return 0, b""

    def metric(self, name: str) -> float:
        """An unlabelled metric from /metrics."""
        for line in self.get("/metrics")[1].decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def log(self) -> str:
        return self.log_path.read_text()

    def assert_alive(self) -> None:
        assert self.process.poll() is None, f"the server died:\n{self.log()[-4000:]}"
        assert self.get("/health")[0] == 200 and self.get("/ready")[0] == 200


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def server_process(options: list[str], log_path: Path, env: dict[str, str] | None = None,
                   python: str = sys.executable, cwd: Path = ROOT) -> Iterator[ServerProcess]:
    """`voxgate serve` with `options` (run by `python` in `cwd`), ready; terminated (and waited for) afterwards."""
    port = free_port()
    with open(log_path, "w") as log:
        process = subprocess.Popen([python, "-m", "realtime.cli", "serve", "--port", str(port), *options],
                                   cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    running = ServerProcess(port, process, log_path)
    try:
        deadline = time.monotonic() + 180
        while running.get("/ready")[0] != 200:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server never became ready:\n{running.log()[-4000:]}")
            time.sleep(0.2)
        yield running
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
