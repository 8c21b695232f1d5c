"""Varlen decode attention in Triton: one query token per request, reading exactly its `length` cached keys.

One program per (request, KV head) serves the query heads that share that KV head (GQA), streaming the keys in
blocks with an online softmax, so cost follows each request's real length rather than the slot capacity. The scores
and the weighted values are two small matrix products (`tl.dot`): the query heads of a group, padded to 16 rows,
against a block of keys. (An earlier form broadcast [heads, keys, dims] products in fp32 registers
and reduced them: at batch 64 it ran ~8x below the caches' bandwidth.) Blocks are as long as the cache's capacity
allows, up to `MAX_BLOCK_N`: the code predictor's 16-position cache takes one block of 16, not a mostly masked 64. A
row's result depends only on its own query, keys and length, never on the other rows of the batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dependent_launch import dependent_launch, wait_for_inputs

MAX_BLOCK_N = 64
MIN_DOT = 16  # tl.dot's smallest side: the query heads and head dims are padded up to it


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, slots_ptr, lengths_ptr,
                   stride_qb, stride_qh, stride_ks, stride_kh, stride_kc, stride_ob, stride_oh,
                   scale, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.load(slots_ptr + row)
    length = tl.load(lengths_ptr + row)
    group = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + group
    dims = tl.arange(0, DIM_PAD)
    q_mask = (group[:, None] < GROUP) & (dims[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=q_mask,
                other=0.0).to(tl.float32)
    k_base = k_ptr + slot * stride_ks + kv_head * stride_kh
    v_base = v_ptr + slot * stride_ks + kv_head * stride_kh
    best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for start in range(0, length, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        valid = cols < length
        kv_mask = valid[:, None] & (dims[None, :] < HEAD_DIM)
        offsets = cols[:, None] * stride_kc + dims[None, :]
        k = tl.load(k_base + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_base + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        correction = tl.exp(best - new_best)
        weights = tl.exp(scores - new_best[:, None])
        total = total * correction + tl.sum(weights, axis=1)
        acc = acc * correction[:, None] + tl.dot(weights, v, input_precision=PRECISION)
        best = new_best
    out = acc / total[:, None]
    tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=q_mask)


def varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     lengths: torch.Tensor) -> torch.Tensor:
    """q [N, Hq, D], one query per row; caches [slots, Hkv, capacity, D] (contiguous in D); row n attends over
    positions 0..lengths[n]-1 of slot slots[n] -> [N, Hq, D]. The products run on fp32 values: in TF32 for bf16 caches
    (a bf16 value is exact in TF32, so the scores are exact products; the softmax weights keep TF32's 10 bits against
    the 7 a bf16 SDPA keeps), in full fp32 ("ieee") for fp32 caches."""
    rows, heads, head_dim = q.shape
    kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    group = heads // kv_heads
    pdl = dependent_launch(q.device)
    _decode_kernel[(rows, kv_heads)](
        q, k_cache, v_cache, out, slots, lengths,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), head_dim ** -0.5,
        GROUP=group, GROUP_PAD=max(MIN_DOT, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        DIM_PAD=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_N=min(MAX_BLOCK_N, max(MIN_DOT, triton.next_power_of_2(capacity))),
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32", PDL=pdl, launch_pdl=pdl,
    )
    return out


def triton_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                            lengths: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, 1, D]; caches [slots, Hkv, capacity, D] (contiguous in D); lengths [B] -> [B, Hq, 1, D]."""
    return varlen_attention(q[:, :, 0].contiguous(), k_cache, v_cache, slots, lengths)[:, :, None]
