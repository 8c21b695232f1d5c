"""Triton kernels that fuse the small steps of a transformer block, for the engine's graphed frame step.

A frame step runs 103 transformer blocks (28 talker, 5 x 15 code predictor) at one token per request, where every
PyTorch op is its own kernel launch costing more than its arithmetic. Each kernel here replaces a chain of them:
residual add + RMSNorm, q/k RMSNorm + RoPE + the K/V cache write, SwiGLU. Every intermediate is rounded to the
model dtype where the reference rounds it (`_rounded`), so the fused path follows the reference's arithmetic.
`TRITON_INTERPRET=1` runs them on the CPU for the tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dependent_launch import dependent_launch, wait_for_inputs


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    """Round an fp32 value to the model dtype and back, as a PyTorch op on model-dtype tensors would."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _add_rms_norm_kernel(residual_ptr, delta_ptr, scale_ptr, weight_ptr, normed_ptr, size, eps,
                         HAS_DELTA: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    dtype = normed_ptr.dtype.element_ty
    x = tl.load(residual_ptr + row * size + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * size + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:  # a LayerScale on the branch, rounded as its own multiply
            delta = _rounded(delta * tl.load(scale_ptr + cols, mask=mask, other=0.0).to(tl.float32), dtype)
        x = _rounded(x + delta, dtype)
        tl.store(residual_ptr + row * size + cols, x.to(dtype), mask=mask)
    normalised = _rounded(x * tl.rsqrt(tl.sum(x * x, axis=0) / size + eps), dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(normed_ptr + row * size + cols, (weight * normalised).to(dtype), mask=mask)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
    """residual [N, H] += delta, or scale * delta with a per-channel `scale` [H] (a LayerScale), in place and
    rounded as the reference's `x + f(x)`; returns RMSNorm(residual). Both [N, H] contiguous."""
    rows, size = residual.shape
    assert residual.is_contiguous() and (delta is None or delta.is_contiguous())
    assert scale is None or delta is not None, "a scale applies to a delta"
    normed = torch.empty_like(residual)
    pdl = dependent_launch(residual.device)
    _add_rms_norm_kernel[(rows,)](residual, residual if delta is None else delta, weight if scale is None else scale,
                                  weight, normed, size, eps, HAS_DELTA=delta is not None, HAS_SCALE=scale is not None,
                                  BLOCK=triton.next_power_of_2(size), PDL=pdl, launch_pdl=pdl)
    return normed


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, q_norm_ptr, k_norm_ptr, inv_freq_ptr, positions_ptr, slots_ptr,
                         q_out_ptr, k_cache_ptr, v_cache_ptr,
                         stride_qkv, stride_cs, stride_ch, stride_cc, eps,
                         Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)  # query heads first, then key heads (each also moves its value head)
    half = HALF
    dims = tl.arange(0, HALF)
    dtype = q_out_ptr.dtype.element_ty
    is_query = head < Q_HEADS
    source = qkv_ptr + row * stride_qkv + head * HEAD_DIM
    x1 = tl.load(source + dims).to(tl.float32)
    x2 = tl.load(source + half + dims).to(tl.float32)
    inv_rms = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM + eps)
    w1 = tl.where(is_query, tl.load(q_norm_ptr + dims), tl.load(k_norm_ptr + dims)).to(tl.float32)
    w2 = tl.where(is_query, tl.load(q_norm_ptr + half + dims), tl.load(k_norm_ptr + half + dims)).to(tl.float32)
    x1 = _rounded(w1 * _rounded(x1 * inv_rms, dtype), dtype)
    x2 = _rounded(w2 * _rounded(x2 * inv_rms, dtype), dtype)
    angle = tl.load(positions_ptr + row).to(tl.float32) * tl.load(inv_freq_ptr + dims)
    cos = _rounded(tl.cos(angle), dtype)
    sin = _rounded(tl.sin(angle), dtype)
    out1 = _rounded(_rounded(x1 * cos, dtype) + _rounded(-x2 * sin, dtype), dtype).to(dtype)
    out2 = _rounded(_rounded(x2 * cos, dtype) + _rounded(x1 * sin, dtype), dtype).to(dtype)
    if is_query:
        target = q_out_ptr + (row * Q_HEADS + head) * HEAD_DIM
        tl.store(target + dims, out1)
        tl.store(target + half + dims, out2)
    else:
        kv_head = head - Q_HEADS
        position = tl.load(positions_ptr + row)
        cache = tl.load(slots_ptr + row) * stride_cs + kv_head * stride_ch + position * stride_cc
        tl.store(k_cache_ptr + cache + dims, out1)
        tl.store(k_cache_ptr + cache + half + dims, out2)
        kv_heads = tl.num_programs(1) - Q_HEADS
        value = source + kv_heads * HEAD_DIM
        tl.store(v_cache_ptr + cache + dims, tl.load(value + dims))
        tl.store(v_cache_ptr + cache + half + dims, tl.load(value + half + dims))


def qk_norm_rope_store(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, inv_freq: torch.Tensor,
                       positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       q_heads: int, eps: float) -> torch.Tensor:
    """qkv [N, (Hq + 2 Hkv) * D] -> queries [N, Hq, D], normed and rotated; the rotated keys and the values are
    written into the caches [slots, Hkv, capacity, D] at (slots[n], positions[n])."""
    rows = qkv.shape[0]
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    queries = torch.empty(rows, q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    pdl = dependent_launch(qkv.device)
    _qk_norm_rope_kernel[(rows, q_heads + kv_heads)](
        qkv, q_norm, k_norm, inv_freq, positions, slots, queries, k_cache, v_cache,
        qkv.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), eps,
        Q_HEADS=q_heads, HEAD_DIM=head_dim, HALF=head_dim // 2, PDL=pdl, launch_pdl=pdl)
    return queries


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, size, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * 2 * size + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * size + size + cols, mask=mask, other=0.0).to(tl.float32)
    activated = _rounded(gate * tl.sigmoid(gate), dtype)
    tl.store(out_ptr + row * size + cols, (activated * up).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate then up) -> silu(gate) * up [N, I]."""
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width // 2))
    pdl = dependent_launch(gate_up.device)
    _silu_mul_kernel[(rows, triton.cdiv(width // 2, block))](gate_up, out, width // 2, BLOCK=block, PDL=pdl,
                                                             launch_pdl=pdl)
    return out
