"""The inputs of one frame step, on the device: what the model runner builds and a CUDA graph replays."""
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
