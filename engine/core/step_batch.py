"""The inputs of one frame step (built on the host, run on the device or replayed by a CUDA graph), and its codes
on their way to the host."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from engine.reference import BatchSampling
from engine.sampling import SamplerBatch


@dataclass
class StepBatch:
    """One row per request of the step."""

    slots: torch.Tensor  # [B] long
    positions: torch.Tensor  # [B] long: where this step's talker token goes (prompt length + frames so far)
    frame_index: torch.Tensor  # [B] long: frames produced so far
    text_ids: torch.Tensor  # [B] long: text-track token for this step
    sampling: BatchSampling

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the batch, in a fixed order (`of_tensors` reads the same order)."""
        sampling = self.sampling
        return [self.slots, self.positions, self.frame_index, self.text_ids, *_sampler_tensors(sampling.talker),
                *_sampler_tensors(sampling.code_predictor), sampling.penalty, sampling.seeds, sampling.min_frames]

    @classmethod
    def of_tensors(cls, tensors: list[torch.Tensor]) -> StepBatch:
        """The batch whose `tensors()` are these."""
        slots, positions, frame_index, text_ids, *rest = tensors
        sampler_fields = len(fields(SamplerBatch))
        talker, code_predictor = rest[:sampler_fields], rest[sampler_fields:2 * sampler_fields]
        penalty, seeds, min_frames = rest[2 * sampler_fields:]
        sampling = BatchSampling(SamplerBatch(*talker), SamplerBatch(*code_predictor), penalty, seeds, min_frames)
        return cls(slots, positions, frame_index, text_ids, sampling)

    def to(self, device: torch.device) -> StepBatch:
        return StepBatch.of_tensors([t.to(device) for t in self.tensors()])


def _sampler_tensors(sampler: SamplerBatch) -> list[torch.Tensor]:
    return [getattr(sampler, f.name) for f in fields(SamplerBatch)]


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
