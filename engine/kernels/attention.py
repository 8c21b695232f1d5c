"""Varlen decode attention in Triton: one query token per request, reading exactly its `length` cached keys.

One program per (request, KV head) serves the query heads that share that KV head (GQA), streaming the keys in
blocks with an online softmax, so cost follows each request's real length rather than the slot capacity.
For a decode step (every row its own slot) `norm_rope_attention` also does `layer_ops.qk_norm_rope_store`'s work in
the same program: one launch per transformer block instead of two, with the same arithmetic (shared helpers).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.layer_ops import _norm_rope, _rope_cos_sin, _store_key_value


@triton.jit
def _attend(q, k_base, v_base, length, stride_kc, scale, dims, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_N: tl.constexpr):
    """Queries q [GROUP, HEAD_DIM] (fp32) over keys 0..length-1 of one cached KV head: the online softmax in blocks
    of BLOCK_N keys. The one attention loop of both kernels, so that they sum in the same order."""
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
    return acc / total[:, None]


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
    cache = slot * stride_ks + kv_head * stride_kh
    out = _attend(q, k_ptr + cache, v_ptr + cache, length, stride_kc, scale, dims, GROUP, HEAD_DIM, BLOCK_N)
    tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + dims[None, :], out.to(out_ptr.dtype.element_ty))


@triton.jit
def _norm_rope_attend_kernel(qkv_ptr, q_norm_ptr, k_norm_ptr, inv_freq_ptr, positions_ptr, slots_ptr,
                             k_cache_ptr, v_cache_ptr, out_ptr,
                             stride_qkv, stride_cs, stride_ch, stride_cc, stride_ob, stride_oh, eps, scale,
                             Q_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                             HALF: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    halves = tl.arange(0, HALF)
    position = tl.load(positions_ptr + row)
    source = qkv_ptr + row * stride_qkv
    cos, sin = _rope_cos_sin(inv_freq_ptr, position, halves, dtype)
    key_source = source + (Q_HEADS + kv_head) * HEAD_DIM
    key1, key2 = _norm_rope(key_source, tl.load(k_norm_ptr + halves).to(tl.float32),
                            tl.load(k_norm_ptr + HALF + halves).to(tl.float32), cos, sin, halves, eps, HEAD_DIM,
                            HALF, dtype)
    cache = tl.load(slots_ptr + row) * stride_cs + kv_head * stride_ch
    _store_key_value(k_cache_ptr, v_cache_ptr, cache + position * stride_cc, key1, key2,
                     key_source + tl.num_programs(1) * HEAD_DIM, halves, HALF)
    tl.debug_barrier()  # the new key and value, stored by some threads, are read back by all in the loop below
    w1 = tl.load(q_norm_ptr + halves).to(tl.float32)
    w2 = tl.load(q_norm_ptr + HALF + halves).to(tl.float32)
    group = tl.arange(0, GROUP)
    q = tl.zeros([GROUP, HEAD_DIM], tl.float32)
    for index in tl.static_range(GROUP):  # each query head as the prefill kernel computes it, then into its row
        q1, q2 = _norm_rope(source + (kv_head * GROUP + index) * HEAD_DIM, w1, w2, cos, sin, halves, eps,
                            HEAD_DIM, HALF, dtype)
        head = tl.reshape(tl.permute(tl.join(q1, q2), (1, 0)), (HEAD_DIM,)).to(tl.float32)
        q = tl.where(group[:, None] == index, head[None, :], q)
    dims = tl.arange(0, HEAD_DIM)
    out = _attend(q, k_cache_ptr + cache, v_cache_ptr + cache, position + 1, stride_cc, scale, dims, GROUP,
                  HEAD_DIM, BLOCK_N)
    heads = kv_head * GROUP + group
    tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + dims[None, :], out.to(dtype))


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


def norm_rope_attention(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, inv_freq: torch.Tensor,
                        positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        q_heads: int, eps: float, block_n: int = 64) -> torch.Tensor:
    """`qk_norm_rope_store` then `varlen_attention` over lengths positions + 1 as one launch, bit for bit, for a
    decode step: every row has its own slot, so a program stores its row's new key and value and attends at once
    (rows that share a slot, a prefill, need every key stored before any row attends: the two kernels).
    qkv [N, (Hq + 2 Hkv) * D] -> [N, Hq, D]."""
    rows = qkv.shape[0]
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    out = torch.empty(rows, q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _norm_rope_attend_kernel[(rows, kv_heads)](
        qkv, q_norm, k_norm, inv_freq, positions, slots, k_cache, v_cache, out,
        qkv.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1), eps,
        head_dim ** -0.5, Q_HEADS=q_heads, GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
        BLOCK_N=block_n)
    return out
