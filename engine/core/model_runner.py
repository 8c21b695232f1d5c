"""The batched model step over slots: prefill of several new requests in one pass, and the whole frame step
(sample code 0, the 15 code-predictor sub-steps, then one talker token per request) with all per-request state on
the device, so a step needs no host synchronisation inside and one device-to-host copy of its codes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.frame_path import TorchFramePath
from engine.core.kv_cache import CacheShape, SlotKVCache
from engine.model.talker import Talker
from engine.reference import BatchSampling
from engine.sampling import talker_logits_mask


@dataclass
class StepBatch:
    """The inputs of one frame step, one row per running request."""

    slots: torch.Tensor  # [B] long
    positions: torch.Tensor  # [B] long: where this step's talker token goes (prompt length + frames so far)
    frame_index: torch.Tensor  # [B] long: frames produced so far
    text_ids: torch.Tensor  # [B] long: text-track token for this step
    sampling: BatchSampling


class ModelRunner:
    def __init__(self, talker: Talker, cache_shape: CacheShape, device: torch.device, dtype: torch.dtype,
                 attention_backend: str = "sdpa", frame_path: str = "torch") -> None:
        cfg = talker.cfg
        self.talker = talker
        self.device = device
        self.cache = SlotKVCache(cache_shape, dtype, device, attention_backend)
        slots = cache_shape.slots + 1  # the last one is the scratch slot (padding rows of graphed batches)
        self.scratch_slot = cache_shape.slots
        self.last_hidden = torch.zeros(slots, cfg.layers.hidden_size, dtype=dtype, device=device)
        self.seen = torch.zeros(slots, cfg.vocab_size, dtype=torch.bool, device=device)
        self.suppressed = talker_logits_mask(cfg.vocab_size, cfg.codec_eos_token_id, device)
        self._true = torch.ones((), dtype=torch.bool, device=device)  # a device scalar: graph capture copies none
        if frame_path == "triton":  # imported here: Triton is only needed (and installed) where it runs
            from engine.core.fused_frame_path import FusedFramePath

            self.frame = FusedFramePath(talker, self.cache, slots)
        else:
            self.frame = TorchFramePath(talker, self.cache)

    @property
    def capacity(self) -> int:
        return self.cache.shape.capacity

    @torch.inference_mode()
    def prefill(self, slots: list[int], prompts: list[torch.Tensor]) -> None:
        """Run the prompts [P_i, H] of new requests as one batch into their slots."""
        slot_index = torch.tensor(slots, device=self.device)
        self.last_hidden[slot_index] = self.frame.prefill(slot_index, prompts)
        self.seen[slot_index] = False

    @torch.inference_mode()
    def step(self, batch: StepBatch) -> torch.Tensor:
        """One frame for every row: codes [B, 16] (code 0 may be EOS); advances each slot by one position."""
        talker = self.talker
        hidden = self.last_hidden[batch.slots]
        codes = self.frame.sample(hidden, self.seen[batch.slots], batch.frame_index, batch.sampling, self.suppressed)
        step_input = talker.frame_embed(codes) + talker.text_embed(batch.text_ids)
        hidden = self.frame.advance(step_input, batch.slots, batch.positions)
        # A request's state advances only here, at the end: a step that raised before can run again (engine.py).
        self.seen.index_put_((batch.slots, codes[:, 0]), self._true)
        self.last_hidden[batch.slots] = hidden
        return codes
