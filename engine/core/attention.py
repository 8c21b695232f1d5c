"""Decode attention over slot caches: one query per request, reading only that request's keys.

Backends: `sdpa` (any device: a masked SDPA over the slot's capacity, the simple reference) and `triton` (GPU: a
varlen kernel that reads exactly `length` keys per request; `TRITON_INTERPRET=1` runs it on the CPU for tests).
"""
from __future__ import annotations

import torch

from engine.model.layers import gqa_attention

BACKENDS = ("sdpa", "triton")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     lengths: torch.Tensor, backend: str = "sdpa") -> torch.Tensor:
    """q [B, Hq, 1, D]; caches [slots, Hkv, capacity, D]; lengths [B] -> [B, Hq, 1, D]."""
    if backend == "triton":
        from engine.kernels.attention import triton_decode_attention

        return triton_decode_attention(q, k_cache, v_cache, slots, lengths)
    keys, values = k_cache[slots], v_cache[slots]
    visible = torch.arange(keys.shape[2], device=q.device)[None, :] < lengths[:, None]
    return gqa_attention(q, keys, values, attn_mask=visible[:, None, None])
