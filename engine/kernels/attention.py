"""Varlen decode attention in Triton: one query token per request, reading exactly its `length` cached keys.

One program per (request, KV head) serves the query heads that share that KV head (GQA), streaming the keys in
blocks with an online softmax, so cost follows each request's real length rather than the slot capacity. The scores
and the weighted values are two small matrix products (`tl.dot`): the query heads of a group, padded to 16 rows,
against a block of keys. (An earlier form broadcast [heads, keys, dims] products in fp32 registers
and reduced them: at batch 64 it ran ~8x below the caches' bandwidth.) Blocks are as long as the cache's capacity
allows, up to `MAX_BLOCK_N`: the code predictor's 16-position cache takes one block of 16, not a mostly masked 64. A
row's result depends only on its own query, keys and length, never on the other rows of the batch.

A decode step's token may come as its raw q/k/v projection (`new_token_attention`): each program first does that
token's q/k RMSNorm and RoPE for its KV head (`_normed_rotated`), writes its key and value into the cache, and then
attends, one launch where there were two (a row that is alone in its slot only waits for its own program's
writes). `store_new_tokens` is that first part alone, for rows that share a slot (a prefill), whose keys must all be
stored before any row attends.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dependent_launch import dependent_launch, wait_for_inputs
from engine.kernels.layer_ops import roped, rounded

MAX_BLOCK_N = 64
MIN_DOT = 16  # tl.dot's smallest side: the query heads and head dims are padded up to it


@triton.jit
def _normed_rotated(qkv_ptr, offsets, norm_ptr, inv_freq_ptr, position, eps, dims, row_mask,
                    HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr):
    """Heads [R, D_PAD] of a token's projection at `qkv_ptr + offsets` ([R, 1]): RMSNorm with weights `norm_ptr`,
    then RoPE at `position`, each step rounded to the model dtype where the reference rounds it (fp32 values)."""
    half: tl.constexpr = HEAD_DIM // 2
    first = dims < half
    partner = tl.where(first, dims + half, dims - half)  # rotate_half's source for each dim
    dim_mask = dims < HEAD_DIM
    mask = row_mask[:, None] & dim_mask[None, :]
    x = tl.load(qkv_ptr + offsets + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    mate = tl.load(qkv_ptr + offsets + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
    weight = tl.load(norm_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    mate_weight = tl.load(norm_ptr + partner, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    x = rounded(weight * rounded(x * inv_rms, DTYPE), DTYPE)
    mate = rounded(mate_weight * rounded(mate * inv_rms, DTYPE), DTYPE)
    angle = position.to(tl.float32) * tl.load(inv_freq_ptr + dims % half, mask=dim_mask, other=0.0)[None, :]
    cos = rounded(tl.cos(angle), DTYPE)
    sin = rounded(tl.sin(angle), DTYPE)
    return roped(x, mate, first[None, :], cos, sin, DTYPE)


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, slots_ptr, lengths_ptr, q_norm_ptr, k_norm_ptr, inv_freq_ptr,
                   stride_qb, stride_qh, stride_ks, stride_kh, stride_kc, stride_ob, stride_oh,
                   scale, eps, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, NEW_TOKEN: tl.constexpr,
                   ATTEND: tl.constexpr, PDL: tl.constexpr):
    """Program (row, KV head). NEW_TOKEN: q_ptr is the token's q/k/v projection [N, (Hq + 2 Hkv) * D]; its key and
    value are stored at position length - 1 first. ATTEND off: only that, and the queries go to out_ptr."""
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.load(slots_ptr + row)
    length = tl.load(lengths_ptr + row)
    group = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + group
    dims = tl.arange(0, DIM_PAD)
    q_mask = (group[:, None] < GROUP) & (dims[None, :] < HEAD_DIM)
    k_base = k_ptr + slot * stride_ks + kv_head * stride_kh
    v_base = v_ptr + slot * stride_ks + kv_head * stride_kh
    if NEW_TOKEN:
        dtype = q_ptr.dtype.element_ty
        position = length - 1
        q_heads = tl.num_programs(1) * GROUP
        q = _normed_rotated(q_ptr, row * stride_qb + heads[:, None] * HEAD_DIM, q_norm_ptr, inv_freq_ptr, position,
                            eps, dims, group < GROUP, HEAD_DIM, dtype)
        own = group < 1  # the KV head's key and value: one row of the same layout
        key_offsets = row * stride_qb + (q_heads + kv_head + group[:, None] * 0) * HEAD_DIM
        key = _normed_rotated(q_ptr, key_offsets, k_norm_ptr, inv_freq_ptr, position, eps, dims, own, HEAD_DIM, dtype)
        kv_mask = own[:, None] & (dims[None, :] < HEAD_DIM)
        cache = position * stride_kc + group[:, None] * 0 + dims[None, :]
        tl.store(k_base + cache, key.to(dtype), mask=kv_mask)
        value = tl.load(q_ptr + key_offsets + tl.num_programs(1) * HEAD_DIM + dims[None, :], mask=kv_mask)
        tl.store(v_base + cache, value, mask=kv_mask)
        if ATTEND:
            tl.debug_barrier()  # the program's stores of the key and value are visible to all its threads
    else:
        q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=q_mask,
                    other=0.0).to(tl.float32)
    if ATTEND:
        q = _attended(q, k_base, v_base, length, dims, stride_kc, scale, GROUP_PAD, HEAD_DIM, DIM_PAD, BLOCK_N,
                      PRECISION)
    tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + dims[None, :], q.to(out_ptr.dtype.element_ty),
             mask=q_mask)


@triton.jit
def _attended(q, k_base, v_base, length, dims, stride_kc, scale, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
              DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Queries [GROUP_PAD, DIM_PAD] (fp32) over the cached keys and values at positions 0..length-1."""
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
    return acc / total[:, None]


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
            lengths: torch.Tensor, out: torch.Tensor, *, new_token: tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                          float] | None = None,
            attend: bool = True) -> torch.Tensor:
    """The kernel over rows x KV heads; `new_token` = (q_norm, k_norm, inv_freq, eps) when q is a q/k/v projection."""
    kv_heads, capacity, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    heads = out.shape[1]
    group = heads // kv_heads
    q_norm, k_norm, inv_freq, eps = new_token if new_token is not None else (q, q, q, 0.0)
    pdl = dependent_launch(q.device)
    _decode_kernel[(q.shape[0], kv_heads)](
        q, k_cache, v_cache, out, slots, lengths, q_norm, k_norm, inv_freq,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), head_dim ** -0.5, eps,
        GROUP=group, GROUP_PAD=max(MIN_DOT, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        DIM_PAD=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_N=min(MAX_BLOCK_N, max(MIN_DOT, triton.next_power_of_2(capacity))),
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32", NEW_TOKEN=new_token is not None,
        ATTEND=attend, PDL=pdl, launch_pdl=pdl,
    )
    return out


def varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     lengths: torch.Tensor) -> torch.Tensor:
    """q [N, Hq, D], one query per row; caches [slots, Hkv, capacity, D] (contiguous in D); row n attends over
    positions 0..lengths[n]-1 of slot slots[n] -> [N, Hq, D]. The products run on fp32 values: in TF32 for bf16 caches
    (a bf16 value is exact in TF32, so the scores are exact products; the softmax weights keep TF32's 10 bits against
    the 7 a bf16 SDPA keeps), in full fp32 ("ieee") for fp32 caches."""
    return _launch(q, k_cache, v_cache, slots, lengths, torch.empty_like(q))


def store_new_tokens(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, inv_freq: torch.Tensor,
                     lengths: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     q_heads: int, eps: float) -> torch.Tensor:
    """qkv [N, (Hq + 2 Hkv) * D], row n the token at position lengths[n] - 1 of slot slots[n] -> its queries
    [N, Hq, D], normed and rotated; the rotated keys and the values are written into the caches [slots, Hkv,
    capacity, D]."""
    queries = torch.empty(qkv.shape[0], q_heads, k_cache.shape[3], dtype=qkv.dtype, device=qkv.device)
    return _launch(qkv, k_cache, v_cache, slots, lengths, queries, new_token=(q_norm, k_norm, inv_freq, eps),
                   attend=False)


def new_token_attention(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, inv_freq: torch.Tensor,
                        lengths: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        q_heads: int, eps: float) -> torch.Tensor:
    """`store_new_tokens` then `varlen_attention` in one launch, for rows that are each alone in their slot (a
    decode step) -> [N, Hq, D]."""
    attended = torch.empty(qkv.shape[0], q_heads, k_cache.shape[3], dtype=qkv.dtype, device=qkv.device)
    return _launch(qkv, k_cache, v_cache, slots, lengths, attended, new_token=(q_norm, k_norm, inv_freq, eps))


def triton_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                            lengths: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, 1, D]; caches [slots, Hkv, capacity, D] (contiguous in D); lengths [B] -> [B, Hq, 1, D]."""
    return varlen_attention(q[:, :, 0].contiguous(), k_cache, v_cache, slots, lengths)[:, :, None]
