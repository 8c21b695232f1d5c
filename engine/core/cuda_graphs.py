"""The whole frame step captured as one CUDA graph per batch-size bucket.

A step launches ~6,500 small kernels on the torch frame path and ~1,170 on the fused one (28 talker layers, 15
code-predictor sub-steps, sampling; `scripts/profile_step.py`); replaying a graph turns that into one launch. A
batch is padded up to its bucket with rows that point at the runner's scratch slot, so the graph's shapes never
change and real rows are untouched by the padding. Without graphs (`capture=False`)
the same padded batches run eagerly: that is how the padding is tested on the CPU.
"""
from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

import torch

from engine.core.step_batch import StepBatch
from engine.reference import BatchSampling
from engine.sampling import SamplerBatch

if TYPE_CHECKING:
    from engine.core.model_runner import ModelRunner

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def _sampler_tensors(sampler: SamplerBatch) -> list[torch.Tensor]:
    return [getattr(sampler, f.name) for f in fields(SamplerBatch)]


def _tensors(batch: StepBatch) -> list[torch.Tensor]:
    """Every tensor of a step batch, in a fixed order."""
    sampling = batch.sampling
    return [batch.slots, batch.positions, batch.frame_index, batch.text_ids,
            *_sampler_tensors(sampling.talker), *_sampler_tensors(sampling.code_predictor),
            sampling.penalty, sampling.seeds, sampling.min_frames]


class _Bucket:
    def __init__(self, static: StepBatch, padding: StepBatch) -> None:
        self.static, self.padding = static, padding
        self.graph: torch.cuda.CUDAGraph | None = None
        self.codes: torch.Tensor | None = None


class PaddedStep:
    def __init__(self, runner: ModelRunner, pad_text_id: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS,
                 capture: bool = True) -> None:
        self.runner = runner
        self.pad_text_id = pad_text_id
        sizes = sorted(b for b in buckets if b <= runner.cache.shape.slots) or [1]
        self.buckets = {size: _Bucket(self._padding_batch(size), self._padding_batch(size)) for size in sizes}
        if capture:
            self._capture()

    def _padding_batch(self, size: int) -> StepBatch:
        device = self.runner.device

        def full(value, dtype=torch.long) -> torch.Tensor:
            return torch.full((size,), value, dtype=dtype, device=device)

        def sampler() -> SamplerBatch:
            return SamplerBatch(full(False, torch.bool), full(1.0, torch.float32), full(0), full(1.0, torch.float32))

        sampling = BatchSampling(sampler(), sampler(), full(1.0, torch.float32), full(0), full(0))
        return StepBatch(full(self.runner.scratch_slot), full(0), full(0), full(self.pad_text_id), sampling)

    @torch.inference_mode()
    def _capture(self) -> None:
        # One capture stream for the engine's lifetime, so per-stream resources the captured kernels use (the
        # cuBLAS workspace among them) live as long as the graphs.
        self.stream = torch.cuda.Stream()
        for size in sorted(self.buckets, reverse=True):
            bucket = self.buckets[size]
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for _ in range(2):
                    self.runner.step(bucket.static)
            torch.cuda.current_stream().wait_stream(self.stream)
            bucket.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(bucket.graph, stream=self.stream):
                bucket.codes = self.runner.step(bucket.static)
        torch.cuda.synchronize()

    def __call__(self, batch: StepBatch) -> torch.Tensor:
        rows = batch.slots.shape[0]
        size = next((b for b in self.buckets if b >= rows), None)
        if size is None:
            return self.runner.step(batch)
        bucket = self.buckets[size]
        for target, source, pad in zip(_tensors(bucket.static), _tensors(batch), _tensors(bucket.padding)):
            target[:rows].copy_(source)
            target[rows:].copy_(pad[rows:])
        if bucket.graph is None:
            return self.runner.step(bucket.static)[:rows]
        bucket.graph.replay()
        return bucket.codes[:rows]
