"""The inputs of one frame step, on the device (what the model runner builds and a CUDA graph replays), and its
codes on their way to the host."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.reference import BatchSampling


@dataclass
class StepBatch:
    """One row per request of the step."""

    slots: torch.Tensor  # [B] long
    positions: torch.Tensor  # [B] long: where this step's talker token goes (prompt length + frames so far)
    frame_index: torch.Tensor  # [B] long: frames produced so far
    text_ids: torch.Tensor  # [B] long: text-track token for this step
    sampling: BatchSampling


@dataclass
class StepCodes:
    """A step's codes [B, 16]. On a GPU they are copied to the host as soon as they are sampled, while the talker's
    advance (the step's second half) still runs: `host()` waits only for the copy, so the host reads the codes, and
    the codec decoder starts on them, before the step has finished."""

    codes: torch.Tensor  # on the device, or already on the host
    ready: torch.cuda.Event | None = None  # fires once `codes` (a pinned host buffer) holds them

    def host(self) -> torch.Tensor:
        """The codes on the host, a tensor of their own (a graph's pinned buffer is rewritten by its next replay)."""
        if self.ready is None:
            return self.codes.cpu()
        self.ready.synchronize()
        return self.codes.clone()

    def landed(self) -> "StepCodes":
        """The codes copied out now (before the graph that made them runs again)."""
        return StepCodes(self.host())
