"""A frame path is the model work of the engine's steps behind one interface: prefill new requests into their
slots, sample a frame from the talker's hidden states, advance the talker by one token per request.

`torch` (`TorchFramePath`, here) is the model's own PyTorch code on any device: the reference the engine is checked
against. `triton` (`fused_frame_path.FusedFramePath`) runs the same arithmetic through fused kernels.
"""
from __future__ import annotations

import torch

from engine.core.kv_cache import SlotKVCache
from engine.model.talker import Talker
from engine.reference import BatchSampling, sample_frame

FRAME_PATHS = ("torch", "triton")


class TorchFramePath:
    def __init__(self, talker: Talker, cache: SlotKVCache) -> None:
        self.talker, self.cache = talker, cache

    def prefill(self, prompts: list[torch.Tensor], slot_ids: list[int]) -> torch.Tensor:
        """Prompts [P_i, H] into their slots as one right-padded batch -> each one's last hidden state [B, H]."""
        device = prompts[0].device
        slots = torch.tensor(slot_ids, device=device)
        lengths = torch.tensor([p.shape[0] for p in prompts], device=device)
        width = int(lengths.max())
        batch = torch.zeros(len(prompts), width, prompts[0].shape[1], dtype=prompts[0].dtype, device=device)
        for row, prompt in enumerate(prompts):
            batch[row, : prompt.shape[0]] = prompt
        positions = torch.arange(width, device=device).expand(len(prompts), width)
        hidden = self.talker.model(batch, positions, self.cache.prefill_attends(slots, lengths))
        return hidden[torch.arange(len(prompts), device=device), lengths - 1]

    def sample(self, hidden: torch.Tensor, seen: torch.Tensor, frame_index: torch.Tensor, sampling: BatchSampling,
               suppressed: torch.Tensor) -> torch.Tensor:
        """Talker hidden states [B, H] -> codes [B, 16]."""
        return sample_frame(self.talker, hidden, seen, frame_index, sampling, suppressed)

    def advance(self, step_input: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One talker token per request [B, H] at positions [B] of its slot -> new hidden states [B, H]."""
        attends = self.cache.decode_attends(slots, positions)
        return self.talker.model(step_input[:, None], positions[:, None], attends)[:, 0]
