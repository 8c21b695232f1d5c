"""Wait until a voxgate server answers /ready with 200 (its model loaded, its graphs captured); exit 1 after the
timeout. `python3 scripts/device/wait_ready.py http://127.0.0.1:8000 [TIMEOUT_S]`"""
from __future__ import annotations

import sys
import time
import urllib.request


def main() -> int:
    url, timeout = sys.argv[1].rstrip("/") + "/ready", float(sys.argv[2]) if len(sys.argv) > 2 else 600.0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
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
