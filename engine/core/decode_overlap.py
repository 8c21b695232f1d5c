"""Codec decoding beside the frame step: the CUDA stream the decodes run on, and their audio's way to the host.

On a GPU the decoder's chunks are queued on their own (higher-priority) CUDA stream right after a step's codes are
known, and the engine launches the next frame step before it looks at them: the decoder, the largest GPU consumer
at high batch, then runs beside the talker instead of after it. The audio is copied to pinned host memory in the
same stream and read once its event has fired; the engine polls the events, so a step waits for a decode only when
it is more than a step old (decoding.py).

Without overlap (or on the CPU) the same calls run in order on the current stream. Overlap on the CPU only defers
the collection by one step, which is how the engine's bookkeeping for it is tested in CI.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class PendingAudio:
    """Decoded rows on their way to the host: row i of `audio` belongs to `owners[i]`."""

    owners: list[Any]
    audio: torch.Tensor  # [B, samples] float32 on the host, valid once `ready` has fired
    ready: torch.cuda.Event | None
    step: int = 0  # the `Decoding.queue` call that queued it

    def landed(self) -> bool:
        """The audio is on the host (polled: never waits)."""
        return self.ready is None or self.ready.query()

    def wait(self) -> np.ndarray:
        if self.ready is not None:
            self.ready.synchronize()
        return self.audio.numpy()


class DecodeOverlap:
    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.enabled = enabled
        self.stream = torch.cuda.Stream(device, priority=-1) if enabled and device.type == "cuda" else None

    def context(self):
        """Every decoder-state operation (reset, priming, decode) runs in here, so they stay in order."""
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def to_host(self, owners: list[Any], audio: torch.Tensor) -> PendingAudio:
        """Start the copy of decoded audio to the host (call inside `context()`)."""
        if self.stream is None:
            return PendingAudio(owners, audio.float().cpu(), None)
        host = audio.float().to("cpu", non_blocking=True)  # a pinned destination: the copy is asynchronous
        ready = torch.cuda.Event()
        ready.record(self.stream)
        return PendingAudio(owners, host, ready)
