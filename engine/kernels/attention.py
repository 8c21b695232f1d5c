"""Varlen decode attention in Triton: one query token per request, reading exactly its `length` cached keys.

One program per (request, KV head) serves the query heads that share that KV head (GQA), streaming the keys in
blocks with an online softmax, so cost follows each request's real length rather than the slot capacity.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, slots_ptr, lengths_ptr,
                   stride_qb, stride_qh, stride_ks, stride_kh, stride_kc, stride_ob, stride_oh,
                   scale, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.load(slots_ptr + row)
    length = tl.load(lengths_ptr + row)
    heads = kv_head * GROUP + tl.arange(0, GROUP)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + dims[None, :]).to(tl.float32)
    k_base = k_ptr + slot * stride_ks + kv_head * stride_kh
    v_base = v_ptr + slot * stride_ks + kv_head * stride_kh
    best = tl.full([GROUP], float("-inf"), tl.float32)
    total = tl.zeros([GROUP], tl.float32)
    acc = tl.zeros([GROUP, HEAD_DIM], tl.float32)
    for start in range(0, length, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        valid = cols < length
        offsets = cols[:, None] * stride_kc + dims[None, :]
        k = tl.load(k_base + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_base + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        correction = tl.exp(best - new_best)
        weights = tl.exp(scores - new_best[:, None])
        total = total * correction + tl.sum(weights, axis=1)
        acc = acc * correction[:, None] + tl.sum(weights[:, :, None] * v[None, :, :], axis=1)
        best = new_best
    out = acc / total[:, None]
    tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + dims[None, :], out.to(out_ptr.dtype.element_ty))


def varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     lengths: torch.Tensor, block_n: int = 64) -> torch.Tensor:
    """q [N, Hq, D], one query per row; caches [slots, Hkv, capacity, D] (contiguous in D); row n attends over
    positions 0..lengths[n]-1 of slot slots[n] -> [N, Hq, D]."""
    rows, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    out = torch.empty_like(q)
    _decode_kernel[(rows, kv_heads)](
        q, k_cache, v_cache, out, slots, lengths,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), head_dim ** -0.5,
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_N=block_n,
    )
    return out


def triton_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                            lengths: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, 1, D]; caches [slots, Hkv, capacity, D] (contiguous in D); lengths [B] -> [B, Hq, 1, D]."""
    return varlen_attention(q[:, :, 0].contiguous(), k_cache, v_cache, slots, lengths)[:, :, None]
