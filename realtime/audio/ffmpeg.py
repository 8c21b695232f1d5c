"""FFmpeg (through PyAV) on one thread per graph and codec in the gateway.

FFmpeg sizes each filter graph's and codec's thread pool by the machine's CPU count: every whole or streamed
container response (PyAV re-frames its audio through a filter graph) and every `speed` other than 1 (the `atempo`
graph) started that many threads, 16 a graph on a 16-core host, for work of a few milliseconds a chunk. And the
objects that own them sit in reference cycles inside PyAV, so a response its client left kept its threads until a
full garbage collection (+2 threads a request on a 2-core box, 333 after 200 requests: a hostile try's finding).
The gateway spreads responses over its own worker threads already, so FFmpeg is told there is one CPU.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import av  # noqa: F401  (loads PyAV's libavutil, the copy whose CPU count is set)

log = logging.getLogger("voxgate")


def use_one_thread() -> None:
    """Make FFmpeg count one CPU (`av_cpu_force_count`) in the libavutil this process loaded (PyAV's own copy: another
    one found on the system would not be the one its graphs ask); a warning where it is not found."""
    path = _loaded("libavutil")
    if path is None:
        log.warning("PyAV's libavutil not found among the loaded libraries: FFmpeg keeps a thread pool per graph and "
                    "codec")
        return
    ctypes.CDLL(path).av_cpu_force_count(ctypes.c_int(1))


def _loaded(name: str) -> str | None:
    """The file of a shared library this process has mapped whose name starts with `name` (Linux)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    for line in maps.read_text().splitlines():
        file = line.split(maxsplit=5)[-1]
        if Path(file).name.startswith(name + "-") or Path(file).name.startswith(name + ".so"):
            return file
    return None
