"""The codec decoder's sliding-window attention in one Triton kernel: RoPE on the new queries and keys, the window's
shift, and masked softmax attention over the window, for the decoder pool's graphed calls.

In PyTorch each of the decoder transformer's 8 layers spends ~16 launches here (RoPE's multiplies and halves, two
`cat`s, the scores' product, scale, mask, softmax, cast, the weighted sum and its transpose), each far cheaper than
its launch at the pool's small batches. One program per (row, query head) holds its KV head's window plus the new
frames (at most `window + n` keys of `head_dim`) and does all of it; the program of a group's first head also writes
the shifted window, the state of the next call. Each intermediate is rounded to the model dtype where the PyTorch
code (`WindowAttention`) rounds it, so the fast path follows its arithmetic; `TRITON_INTERPRET=1` runs it on the CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dependent_launch import dependent_launch, wait_for_inputs
from engine.kernels.layer_ops import _rounded


@triton.jit
def _roped(ptr, partner_ptr, first_half, cos, sin, mask, DTYPE: tl.constexpr):
    """apply_rope of the values at `ptr`: x * cos + rotate_half(x) * sin, rounded as PyTorch rounds it; `partner_ptr`
    points at each value's partner in the other half of its head, `first_half` where it is negated."""
    x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(partner_ptr, mask=mask, other=0.0).to(tl.float32)
    rotated = tl.where(first_half, -partner, partner)
    return _rounded(_rounded(x * cos, DTYPE) + _rounded(rotated * sin, DTYPE), DTYPE)


@triton.jit
def _window_attention_kernel(qkv_ptr, cos_ptr, sin_ptr, past_k_ptr, past_v_ptr, position_ptr, out_ptr,
                             new_k_ptr, new_v_ptr, frames, stride_qkv_b, stride_qkv_n, stride_rope_b, stride_rope_n,
                             stride_past_b, stride_past_h, stride_past_t, stride_out_b, stride_out_n,
                             stride_new_b, stride_new_h, stride_new_t, scale,
                             HEADS: tl.constexpr, GROUP: tl.constexpr, WINDOW: tl.constexpr,
                             HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                             PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    kv_heads = HEADS // GROUP
    dtype = out_ptr.dtype.element_ty
    position = tl.load(position_ptr + row)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    # key r of the tile: the window's cached frame r (r < WINDOW), then the call's new frame r - WINDOW
    keys = tl.arange(0, BLOCK_T)
    cached = keys < WINDOW
    new = (keys >= WINDOW) & (keys < WINDOW + frames)
    frame = tl.where(new, keys - WINDOW, 0)
    past = row * stride_past_b + kv_head * stride_past_h + keys[:, None] * stride_past_t + dims[None, :]
    new_k = qkv_ptr + row * stride_qkv_b + frame[:, None] * stride_qkv_n + (HEADS + kv_head) * HEAD_DIM + dims[None, :]
    rope = row * stride_rope_b + frame[:, None] * stride_rope_n + dims[None, :]
    cached_mask = cached[:, None] & dim_mask[None, :]
    new_mask = new[:, None] & dim_mask[None, :]
    half = HEAD_DIM // 2
    cos = tl.load(cos_ptr + rope, mask=new_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + rope, mask=new_mask, other=0.0).to(tl.float32)
    first_half = dims < half
    partner_shift = tl.where(first_half, half, -half)
    k_new = _roped(new_k, new_k + partner_shift[None, :], first_half[None, :], cos, sin, new_mask, dtype)
    k = tl.where(new_mask, k_new, tl.load(past_k_ptr + past, mask=cached_mask, other=0.0).to(tl.float32))
    v = tl.where(new_mask,
                 tl.load(new_k + kv_heads * HEAD_DIM, mask=new_mask, other=0.0).to(tl.float32),
                 tl.load(past_v_ptr + past, mask=cached_mask, other=0.0).to(tl.float32))
    for i in range(0, frames):
        rope_i = row * stride_rope_b + i * stride_rope_n + dims
        query = qkv_ptr + row * stride_qkv_b + i * stride_qkv_n + head * HEAD_DIM + dims
        q = _roped(query, query + partner_shift, first_half,
                   tl.load(cos_ptr + rope_i, mask=dim_mask, other=0.0).to(tl.float32),
                   tl.load(sin_ptr + rope_i, mask=dim_mask, other=0.0).to(tl.float32), dim_mask, dtype)
        scores = _rounded(_rounded(tl.sum(q[None, :] * k, axis=1), dtype) * scale, dtype)
        # frame position + i sees the WINDOW frames up to its own (keys i+1 .. i+WINDOW), none before the stream
        visible = (keys > i) & (keys <= i + WINDOW) & (keys >= WINDOW - position)
        scores = tl.where(visible, scores, float("-inf"))
        weights = tl.exp(scores - tl.max(scores, axis=0))
        weights = _rounded(weights / tl.sum(weights, axis=0), dtype)
        out = tl.sum(weights[:, None] * v, axis=0)
        tl.store(out_ptr + row * stride_out_b + i * stride_out_n + head * HEAD_DIM + dims, out.to(dtype),
                 mask=dim_mask)
    if head % GROUP == 0:  # the next call's window: the last WINDOW keys of the tile
        kept = (keys >= frames) & (keys < frames + WINDOW)
        target = row * stride_new_b + kv_head * stride_new_h + (keys[:, None] - frames) * stride_new_t + dims[None, :]
        kept_mask = kept[:, None] & dim_mask[None, :]
        tl.store(new_k_ptr + target, k.to(dtype), mask=kept_mask)
        tl.store(new_v_ptr + target, v.to(dtype), mask=kept_mask)


def window_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past_keys: torch.Tensor,
                     past_values: torch.Tensor, position: torch.Tensor, heads: int,
                     new_keys: torch.Tensor | None = None, new_values: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`WindowAttention`'s attention for qkv [B, n, (Hq + 2 Hkv) D] (the merged projection), cos / sin [B, n, D],
    the window's past keys / values [B, Hkv, W, D] (unit stride in D; the same strides) and the frames decoded so
    far [B] -> (out [B, n, Hq D], the next call's keys and values [B, Hkv, W, D]), written into `new_keys` /
    `new_values` if given (the same strides, unit in D; never the past's memory: other programs still read it)."""
    rows, frames, _ = qkv.shape
    kv_heads, window, head_dim = past_keys.shape[1:]
    assert qkv.stride(2) == 1 and cos.stride(2) == 1 and cos.stride() == sin.stride()
    assert past_keys.stride() == past_values.stride() and past_keys.stride(3) == 1
    out = torch.empty(rows, frames, heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    if new_keys is None or new_values is None:
        new_keys = torch.empty(rows, kv_heads, window, head_dim, dtype=qkv.dtype, device=qkv.device)
        new_values = torch.empty_like(new_keys)
    assert new_keys.stride() == new_values.stride() and new_keys.stride(3) == 1
    pdl = dependent_launch(qkv.device)
    _window_attention_kernel[(rows, heads)](
        qkv, cos, sin, past_keys, past_values, position, out, new_keys, new_values, frames,
        qkv.stride(0), qkv.stride(1), cos.stride(0), cos.stride(1),
        past_keys.stride(0), past_keys.stride(1), past_keys.stride(2), out.stride(0), out.stride(1),
        new_keys.stride(0), new_keys.stride(1), new_keys.stride(2), head_dim ** -0.5, HEADS=heads,
        GROUP=heads // kv_heads, WINDOW=window, HEAD_DIM=head_dim,
        BLOCK_T=triton.next_power_of_2(window + frames), BLOCK_D=triton.next_power_of_2(head_dim), PDL=pdl,
        num_warps=4, launch_pdl=pdl)
    return out, new_keys, new_values
