"""The model side of a step: the talker's KV slots and per-slot state, the batch tensors of the requests a step runs,
their prefill, and the frame step on the configured frame path (eager, padded to buckets, or CUDA graphs; the
fused path pads and graphs its prefills the same way).

The frame step (sample code 0, the 15 code-predictor sub-steps, then one talker token per request) keeps all
per-request state on the device, so a step needs no host synchronisation inside and one device-to-host copy of its
codes. It runs in two halves, `sample` (the codes) and `advance` (the talker's next token), so that the graphed step
can send the codes to the host, and the codec decoder can start on them, while the advance still runs.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from engine.core.attention import BACKENDS
from engine.core.cuda_graphs import PaddedStep
from engine.core.frame_path import FRAME_PATHS, TorchFramePath
from engine.core.kv_cache import CacheShape, SlotKVCache
from engine.core.sequence import Sequence
from engine.core.step_batch import StepBatch, StepCodes
from engine.model.talker import Talker
from engine.reference import BatchSampling
from engine.sampling import talker_logits_mask
from engine.transfer import upload

STEP_MODES = ("eager", "padded", "graphs")
FRAME_PATH_ATTENTION = {"torch": "sdpa", "triton": "triton"}  # the attention each frame path runs by default


def attention_for(frame_path: str, attention: str | None) -> str:
    """The decode attention a frame path runs: its own unless one is named; the fused layers of `triton` attend
    with the Triton kernel only, so naming another for it is an error, not a setting silently ignored."""
    if frame_path not in FRAME_PATHS or (attention is not None and attention not in BACKENDS):
        raise ValueError(f"frame_path must be one of {FRAME_PATHS} and attention_backend None or one of {BACKENDS}")
    if frame_path == "triton" and attention not in (None, "triton"):
        raise ValueError(f"frame_path='triton' attends with its Triton kernel; attention_backend={attention!r} "
                         "would be ignored: leave it None or set 'triton'")
    return attention or FRAME_PATH_ATTENTION[frame_path]


class ModelRunner:
    def __init__(self, talker: Talker, cache_shape: CacheShape, device: torch.device, dtype: torch.dtype,
                 frame_path: str = "torch", attention: str | None = None, step_mode: str = "eager",
                 pad_text_id: int = 0) -> None:
        """`attention`: see `attention_for`; `pad_text_id`: the text token of a padding row (padded step modes)."""
        if step_mode not in STEP_MODES:
            raise ValueError(f"step_mode must be one of {STEP_MODES}")
        cfg = talker.cfg
        self.talker = talker
        self.device = device
        self.cache = SlotKVCache(cache_shape, dtype, device, attention_for(frame_path, attention))
        slots = cache_shape.slots + 1  # the last one is the scratch slot (padding rows of graphed batches)
        self.scratch_slot = cache_shape.slots
        self.last_hidden = torch.zeros(slots, cfg.layers.hidden_size, dtype=dtype, device=device)
        self.seen = torch.zeros(slots, cfg.vocab_size, dtype=torch.bool, device=device)
        self.suppressed = talker_logits_mask(cfg.vocab_size, cfg.codec_eos_token_id, device)
        self._true = torch.ones((), dtype=torch.bool, device=device)  # a device scalar: graph capture copies none
        if frame_path == "triton":  # imported here: Triton is only needed (and installed) where it runs
            from engine.core.fused_frame_path import FusedFramePath

            self.frame = FusedFramePath(talker, self.cache, slots, pad_prefill=step_mode != "eager",
                                        capture=step_mode == "graphs")
        else:
            self.frame = TorchFramePath(talker, self.cache)
        # The frame step as the engine runs it: `eager_step`, or padded to a bucket (replayed as two CUDA graphs).
        self.run: Callable[[StepBatch], StepCodes] = self.eager_step
        if step_mode != "eager":
            self.run = PaddedStep(self, pad_text_id, capture=step_mode == "graphs")

    @property
    def capacity(self) -> int:
        return self.cache.shape.capacity

    def batch(self, seqs: list[Sequence]) -> StepBatch:
        """The step's inputs for `seqs`, one row each, on the host: `run` takes them to the device (the graphed
        step in one copy per dtype that does not wait for the step before)."""

        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long)

        return StepBatch(
            slots=column([s.slot for s in seqs]),
            positions=column([s.prompt.prefill.shape[0] + s.frames for s in seqs]),
            frame_index=column([s.frames for s in seqs]),
            text_ids=column([s.text_id() for s in seqs]),
            sampling=BatchSampling.of([s.sampling for s in seqs]),
        )

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> None:
        """Run the prompts [P_i, H] of newly admitted requests as one batch into their slots."""
        slot_ids = [s.slot for s in seqs]
        slot_index = upload(torch.tensor(slot_ids), self.device)
        self.last_hidden[slot_index] = self.frame.prefill([s.prompt.prefill for s in seqs], slot_ids)
        self.seen.index_fill_(0, slot_index, False)  # `seen[slot_index] = False` waited for the GPU (a sync)

    def eager_step(self, batch: StepBatch) -> StepCodes:
        return StepCodes(self.step(batch.to(self.device)))

    def step(self, batch: StepBatch) -> torch.Tensor:
        """One frame for every row: codes [B, 16] (code 0 may be EOS); advances each slot by one position."""
        codes = self.sample(batch)
        self.advance(batch, codes)
        return codes

    @torch.inference_mode()
    def sample(self, batch: StepBatch) -> torch.Tensor:
        """The step's first half: each row's frame, codes [B, 16], from its talker state (which it leaves as is)."""
        hidden = self.last_hidden[batch.slots]
        return self.frame.sample(hidden, self.seen[batch.slots], batch.frame_index, batch.sampling, self.suppressed)

    @torch.inference_mode()
    def advance(self, batch: StepBatch, codes: torch.Tensor) -> None:
        """The step's second half: the talker takes each row's frame and text token, one position further."""
        talker = self.talker
        step_input = talker.frame_embed(codes) + talker.text_embed(batch.text_ids)
        hidden = self.frame.advance(step_input, batch.slots, batch.positions)
        # A request's state advances only here, at the end: a step that raised before can run again (isolation.py).
        self.seen.index_put_((batch.slots, codes[:, 0]), self._true)
        self.last_hidden[batch.slots] = hidden
