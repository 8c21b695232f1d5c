"""Talker KV memory: one fixed-capacity slot per running request, sized from a memory budget.

A request keeps its slot from prefill to finish, so nothing is ever re-padded or copied between steps; each step
writes one key/value per request at its own position, and attention reads only that request's length.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import TransformerConfig
from engine.core.attention import decode_attention
from engine.model.layers import Attend, gqa_attention


@dataclass(frozen=True)
class CacheShape:
    layers: int
    kv_heads: int
    head_dim: int
    slots: int
    capacity: int  # positions per slot: prompt + frames

    def bytes(self, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * self.slots * self.capacity * element

    @classmethod
    def from_budget(cls, cfg: TransformerConfig, budget_bytes: int, capacity: int, dtype: torch.dtype,
                    max_slots: int) -> "CacheShape":
        per_slot = cls(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 1, capacity).bytes(dtype)
        slots = min(max_slots, budget_bytes // per_slot)
        if slots < 1:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no slot of {capacity} positions "
                             f"({per_slot} bytes each)")
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, int(slots), capacity)


class SlotKVCache:
    def __init__(self, shape: CacheShape, dtype: torch.dtype, device: torch.device | str,
                 backend: str = "sdpa") -> None:
        self.shape = shape
        # One slot more than usable: the scratch slot that padding rows of graphed batches write into.
        size = (shape.layers, shape.slots + 1, shape.kv_heads, shape.capacity, shape.head_dim)
        self.k = torch.zeros(size, dtype=dtype, device=device)
        self.v = torch.zeros(size, dtype=dtype, device=device)
        self.backend = backend

    def prefill_attends(self, slots: torch.Tensor, lengths: torch.Tensor) -> list[Attend]:
        """For a right-padded batch of prompts [B, T]: causal attention within each prompt, keys stored in the
        slots at positions 0..length-1."""
        return [self._prefill_attend(layer, slots, lengths) for layer in range(self.shape.layers)]

    def decode_attends(self, slots: torch.Tensor, positions: torch.Tensor) -> list[Attend]:
        """For one new token per request at `positions` [B]: store it, attend over positions 0..position."""
        return [self._decode_attend(layer, slots, positions) for layer in range(self.shape.layers)]

    def _prefill_attend(self, layer: int, slots: torch.Tensor, lengths: torch.Tensor) -> Attend:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            t = q.shape[2]
            for row, (slot, length) in enumerate(zip(slots.tolist(), lengths.tolist())):
                self.k[layer, slot, :, :length] = k[row, :, :length]
                self.v[layer, slot, :, :length] = v[row, :, :length]
            steps = torch.arange(t, device=q.device)
            visible = (steps[None, :] <= steps[:, None])[None] & (steps[None, None, :] < lengths[:, None, None])
            return gqa_attention(q, k, v, attn_mask=visible[:, None])

        return attend

    def _decode_attend(self, layer: int, slots: torch.Tensor, positions: torch.Tensor) -> Attend:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.k[layer, slots, :, positions] = k[:, :, 0]
            self.v[layer, slots, :, positions] = v[:, :, 0]
            return decode_attention(q, self.k[layer], self.v[layer], slots, positions + 1, self.backend)

        return attend
