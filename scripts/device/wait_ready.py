"""Wait until a voxgate server answers /ready with 200 (its model loaded, its graphs captured); exit 1 after the
timeout, or at once when the server's process (PID, if given) has ended.
`python3 scripts/device/wait_ready.py http://127.0.0.1:8000 [TIMEOUT_S [PID]]`"""
from __future__ import annotations

import os
import sys
import time
import urllib.request


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: it exists
        return True
    return True


def main() -> int:
    url, timeout = sys.argv[1].rstrip("/") + "/ready", float(sys.argv[2]) if len(sys.argv) > 2 else 600.0
    pid = int(sys.argv[3]) if len(sys.argv) > 3 else None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid is not None and not alive(pid):
            print(f"the server (pid {pid}) ended before it was ready", file=sys.stderr)
            return 1
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return 0
        except OSError:
            pass
        time.sleep(1)
    print(f"{url} was not ready within {timeout:g} s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
