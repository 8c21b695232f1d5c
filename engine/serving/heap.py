"""A server's long-lived objects kept out of the garbage collector's way.

Once a server is up, its heap holds ~400,000 objects that live as long as it does (the model's modules and tensors,
the engine, its CUDA graphs, the libraries' modules). Python's full collection walks every one of them: 100-200 ms
in which the process runs nothing else, so every stream's audio stalls at once (under tts_bench at 20 req/s, nine
streams stalled together for ~140 ms). Frozen, they are left out of every collection; what the server makes later
is collected as usual.

Later, the gateway raises the young generation's threshold from 700 allocations to 5,000. What a server makes
while it serves is either short-lived (freed by its reference count before any collection sees it) or a session's
objects, which live for seconds to minutes: with the default thresholds a storm of sessions promoted them through
the generations quickly enough to set off full collections, each walking every live session's objects with the
loop stopped (67-147 ms on the development box for 512 sessions; docs/benchmarks.md, "Garbage collection in a
session storm"). With 5,000 a storm of 512 sessions sees ~30 young collections of ~1 ms and 2 middle ones, no full
one. Not higher: cyclic garbage that holds native memory the collector does not count (PyAV's codecs, ~0.3 MB a
container response) must still be collected within a few dozen requests; at 50,000 a server grew 117 MB over 400
streamed mp3 requests (scripts/abandoned_streams.py).
"""
from __future__ import annotations

import gc

# (young, middle, old): the young generation is collected after this many net allocations, the middle one after
# this many young collections, the old one after this many middle ones (and only when its pending objects pass a
# quarter of it, CPython's own rule)
SERVING_THRESHOLDS = (5_000, 10, 10)
_DEFAULT_THRESHOLDS = gc.get_threshold()


def freeze_long_lived(thresholds: tuple[int, int, int] | None = None) -> None:
    """Collect what is garbage now, then move everything still alive out of the collector's reach; then collect by
    `thresholds` (the gateway's: SERVING_THRESHOLDS; the engine's process keeps CPython's, as measured there)."""
    gc.collect()
    gc.freeze()
    if thresholds is not None:
        gc.set_threshold(*thresholds)


def thaw() -> None:
    """Before long-lived objects are let go (an engine replaced, a server stopped): they are collectable again, so
    the cycles among them are freed rather than kept for good."""
    gc.unfreeze()
    gc.set_threshold(*_DEFAULT_THRESHOLDS)
