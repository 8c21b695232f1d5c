"""The frame step captured as CUDA graphs per batch-size bucket: one for its first half (the codes), one for its
second (the talker's advance).

A step launches ~6,500 small kernels on the torch frame path and ~1,170 on the fused one (28 talker layers, 15
code-predictor sub-steps, sampling; `scripts/profile_step.py`); replaying a graph turns that into one launch. Between
the two replays the codes are copied to pinned host memory and an event is recorded: the host reads them, and queues
their codec decode on its own stream, while the advance runs, so a request's first audio does not wait for the
talker's next token. A batch is padded up to its bucket with rows that point at the runner's scratch slot, so the
graphs' shapes never change and real rows are untouched by the padding. Without graphs (`capture=False`) the same
padded batches run eagerly: that is how the padding is tested on the CPU.

A step's inputs (15 small columns) go up as one copy per dtype from pinned host memory, queued behind the step before
it: fifteen copies from pageable memory each waited for the GPU to finish that step, so the host could not queue the
next step while the talker's advance ran (12% of the engine process at 256 sessions, py-spy).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.core.step_batch import StepBatch, StepCodes
from engine.reference import BatchSampling
from engine.sampling import SamplerBatch

if TYPE_CHECKING:
    from engine.core.model_runner import ModelRunner

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class StagedInputs:
    """A bucket's step inputs: the tensors its graphs read, as rows of one device matrix per dtype, with a host copy
    of each matrix (pinned on a GPU) that a step fills and sends up in one copy per dtype."""

    @torch.inference_mode(False)  # normal tensors: steps write them, in inference mode or not
    def __init__(self, template: StepBatch, device: torch.device) -> None:
        """`template`: the initial values, on the host (the padding rows)."""
        tensors = template.tensors()
        where, rows = [], {}  # each tensor's matrix and row; rows per dtype
        for tensor in tensors:
            where.append((tensor.dtype, rows.get(tensor.dtype, 0)))
            rows[tensor.dtype] = where[-1][1] + 1
        size, pinned = tensors[0].shape[0], device.type == "cuda"
        self.device_rows = {d: torch.empty(n, size, dtype=d, device=device) for d, n in rows.items()}
        self.host_rows = {d: torch.empty(n, size, dtype=d, pin_memory=pinned) for d, n in rows.items()}
        self.static = StepBatch.of_tensors([self.device_rows[d][i] for d, i in where])
        self._host = [self.host_rows[d][i] for d, i in where]
        self._padding = tensors
        for target, value in zip(self._host, tensors):
            target.copy_(value)
        self.device = device
        self._uploaded = torch.cuda.Event() if pinned else None  # fires once the last upload has read the host rows
        self.upload()

    def fill(self, batch: StepBatch) -> None:
        """`batch`'s rows first, padding rows after them, on the host. Waits for the last upload to have read the
        host rows: it has, unless the step before was never waited for (a caller that runs steps without reading
        their codes)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        rows = batch.slots.shape[0]
        for target, source, pad in zip(self._host, batch.tensors(), self._padding):
            target[:rows].copy_(source)
            target[rows:].copy_(pad[rows:])

    def upload(self) -> None:
        """The host rows to the device, queued on the device's current stream, not waited for."""
        for dtype, rows in self.host_rows.items():
            self.device_rows[dtype].copy_(rows, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record(torch.cuda.current_stream(self.device))  # the copies' stream, whatever the device


class _Bucket:
    def __init__(self, inputs: StagedInputs) -> None:
        self.inputs = inputs
        self.sample: torch.cuda.CUDAGraph | None = None
        self.advance: torch.cuda.CUDAGraph | None = None
        self.codes: torch.Tensor | None = None  # the sample graph's output, which the advance graph reads
        self.host_codes: torch.Tensor | None = None  # pinned
        self.ready: torch.cuda.Event | None = None  # recorded once host_codes is written


class PaddedStep:
    def __init__(self, runner: ModelRunner, pad_text_id: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS,
                 capture: bool = True) -> None:
        self.runner = runner
        self.pad_text_id = pad_text_id
        sizes = sorted(b for b in buckets if b <= runner.cache.shape.slots) or [1]
        self.buckets = {size: _Bucket(StagedInputs(self._padding_batch(size), runner.device)) for size in sizes}
        if capture:
            self._capture()

    def _padding_batch(self, size: int) -> StepBatch:
        """A batch of `size` padding rows, on the host."""

        def full(value, dtype=torch.long) -> torch.Tensor:
            return torch.full((size,), value, dtype=dtype)

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
                    self.runner.step(bucket.inputs.static)
            torch.cuda.current_stream().wait_stream(self.stream)
            bucket.sample, bucket.advance = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(bucket.sample, stream=self.stream):
                bucket.codes = self.runner.sample(bucket.inputs.static)
            with torch.cuda.graph(bucket.advance, stream=self.stream):
                self.runner.advance(bucket.inputs.static, bucket.codes)
            with torch.inference_mode(False):  # a normal tensor: each step copies into it outside inference mode
                bucket.host_codes = torch.empty(bucket.codes.shape, dtype=bucket.codes.dtype, pin_memory=True)
            bucket.ready = torch.cuda.Event()
        torch.cuda.synchronize()

    def __call__(self, batch: StepBatch) -> StepCodes:
        """Run the step; its codes land on the host while the advance may still run (`StepCodes.host`)."""
        rows = batch.slots.shape[0]
        size = next((b for b in self.buckets if b >= rows), None)
        if size is None:
            return self.runner.eager_step(batch)
        bucket = self.buckets[size]
        bucket.inputs.fill(batch)
        bucket.inputs.upload()
        if bucket.sample is None:
            return StepCodes(self.runner.step(bucket.inputs.static)[:rows])
        bucket.sample.replay()
        bucket.host_codes.copy_(bucket.codes, non_blocking=True)
        bucket.ready.record()
        bucket.advance.replay()
        return StepCodes(bucket.host_codes[:rows], bucket.ready)
