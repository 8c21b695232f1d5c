"""The talker's prefill captured as one CUDA graph per token-count bucket, so a new request's first frame follows it
within a few ms.

Prefill runs the prompts of the requests admitted in a step as rows of one varlen pass (`FusedLayers`): 28 blocks
of 9 kernels each. Launched from Python that is ~250 launches, several ms of host time (a Triton launch alone costs
tens of us) for ~1 ms of GPU work; a graph replay is one launch. Prompts are short (voice, instruction and the first
text), so a few buckets of total tokens cover them; a batch longer than the largest runs eagerly. Padding rows sit in
the scratch slot at positions 0, 1, ..., where nothing real ever reads, so the real rows are untouched by them.
Without capture (`capture=False`) the same padded passes run eagerly: that is how the padding is tested on the CPU.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.transfer import upload

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)

# x [N, H] (consumed), positions [N], slots [N] -> final-normed hidden states [N, H]
TokenPass = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class _Bucket:
    x: torch.Tensor  # [size, H]
    positions: torch.Tensor  # [size]
    slots: torch.Tensor  # [size]
    graph: torch.cuda.CUDAGraph | None = None
    hidden: torch.Tensor | None = None  # the captured output [size, H]


class PaddedPrefill:
    def __init__(self, tokens: TokenPass, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 scratch_slot: int, capacity: int, buckets: tuple[int, ...] = PREFILL_BUCKETS,
                 capture: bool = True) -> None:
        """`tokens`: the eager pass; buckets larger than a slot's `capacity` are left out (their padding would not
        fit in the scratch slot)."""
        self.tokens = tokens
        self.scratch_slot = scratch_slot
        self.device = device
        self.buckets = {size: _Bucket(torch.zeros(size, hidden_size, dtype=dtype, device=device),
                                      torch.arange(size, device=device),
                                      torch.full((size,), scratch_slot, dtype=torch.long, device=device))
                        for size in sorted(b for b in buckets if b <= capacity)}
        if capture:
            self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        """Largest first, all in one memory pool: a replay's output is read at once, before any other replay."""
        self.stream = torch.cuda.Stream()  # lives as long as the graphs, as PaddedStep's does
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.buckets, reverse=True):
            bucket = self.buckets[size]
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for _ in range(2):  # compile and tune every kernel outside the capture
                    self.tokens(bucket.x.zero_(), bucket.positions, bucket.slots)
            torch.cuda.current_stream().wait_stream(self.stream)
            bucket.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(bucket.graph, pool=pool, stream=self.stream):
                bucket.hidden = self.tokens(bucket.x, bucket.positions, bucket.slots)
        torch.cuda.synchronize()

    def __call__(self, prompts: list[torch.Tensor], slots: list[int]) -> torch.Tensor:
        """The prompts [P_i, H] into their slots as one pass -> each prompt's last hidden state [B, H]."""
        lengths = [p.shape[0] for p in prompts]
        total = sum(lengths)
        size = next((b for b in self.buckets if b >= total), None)
        size = total if size is None else size
        # positions, slots (padding rows: the scratch slot from position 0) and last-token rows, in one copy
        index = torch.empty(2 * size + len(prompts), dtype=torch.long)
        index[:total] = torch.cat([torch.arange(n) for n in lengths])
        index[total:size] = torch.arange(size - total)
        index[size:size + total] = torch.repeat_interleave(torch.tensor(slots), torch.tensor(lengths))
        index[size + total:2 * size] = self.scratch_slot
        index[2 * size:] = torch.tensor(lengths).cumsum(0) - 1
        index = upload(index, self.device)
        positions, rows, last = index[:size], index[size:2 * size], index[2 * size:]
        bucket = self.buckets.get(size)
        if bucket is None:
            return self.tokens(torch.cat(prompts), positions, rows)[last]
        torch.cat(prompts, out=bucket.x[:total])
        bucket.x[total:].zero_()
        bucket.positions.copy_(positions)
        bucket.slots.copy_(rows)
        if bucket.graph is None:
            return self.tokens(bucket.x, bucket.positions, bucket.slots)[last]
        bucket.graph.replay()
        return bucket.hidden[last]
