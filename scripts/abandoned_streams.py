"""Streamed speech requests whose clients leave: N `POST /v1/audio/speech` requests (`stream: true`), each read for
its first bytes and then closed, `--parallel` at a time. Prints one JSON line per `--every` requests: the server's
resident memory and threads (from /proc, given `--server-pid`) and its garbage collections so far (its /metrics).
What a left response holds until a collection (FFmpeg's codecs sit in reference cycles) shows in the memory.

    python scripts/abandoned_streams.py --url http://127.0.0.1:8000 --server-pid PID --requests 400 --format mp3
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from session_storm import collections  # noqa: E402  (the same /metrics reading)


def leave_early(host: str, port: int, body: bytes, read_bytes: int) -> None:
    with socket.create_connection((host, port), timeout=120) as client:
        client.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: voxgate\r\nContent-Type: application/json\r\n"
                       + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        received = 0
        while received < read_bytes:
            data = client.recv(4096)
            if not data:
                break
            received += len(data)


def process_status(pid: int) -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {"rss_mb": int(fields["VmRSS"].split()[0]) // 1024, "threads": int(fields["Threads"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--server-pid", type=int, required=True)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--format", default="mp3")
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--read-bytes", type=int, default=100)
    args = parser.parse_args()
    parts = urlsplit(args.url)
    body = json.dumps({"input": "Some words to say for a while. " * 3, "response_format": args.format,
                       "stream": True, "speed": args.speed}).encode()
    ws_url = f"ws://{parts.netloc}/"  # `collections` reads the /metrics beside any URL of the server
    print(json.dumps({"requests": 0, **process_status(args.server_pid), "gc": collections(ws_url)}), flush=True)
    with ThreadPoolExecutor(args.parallel) as pool:
        for done in range(args.every, args.requests + 1, args.every):
            list(pool.map(lambda _: leave_early(parts.hostname, parts.port, body, args.read_bytes),
                          range(args.every)))
            print(json.dumps({"requests": done, **process_status(args.server_pid), "gc": collections(ws_url)}),
                  flush=True)


if __name__ == "__main__":
    main()
