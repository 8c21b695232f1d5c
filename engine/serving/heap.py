"""A server's long-lived objects kept out of the garbage collector's way.

Once a server is up, its heap holds ~400,000 objects that live as long as it does (the model's modules and tensors,
the engine, its CUDA graphs, the libraries' modules). Python's full collection walks every one of them: 100-200 ms
in which the process runs nothing else, so every stream's audio stalls at once (under tts_bench at 20 req/s, nine
streams stalled together for ~140 ms). Frozen, they are left out of every collection; what the server makes later
is collected as usual.
"""
from __future__ import annotations

import gc


def freeze_long_lived() -> None:
    """Collect what is garbage now, then move everything still alive out of the collector's reach."""
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """Before long-lived objects are let go (an engine replaced, a server stopped): they are collectable again, so
    the cycles among them are freed rather than kept for good."""
    gc.unfreeze()
