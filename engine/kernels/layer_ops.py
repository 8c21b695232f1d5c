"""Triton kernels that fuse the small steps of a transformer block, for the engine's graphed frame step.

A frame step runs 103 transformer blocks (28 talker, 5 x 15 code predictor) at one token per request, where every
PyTorch op is its own kernel launch costing more than its arithmetic. Each kernel here replaces a chain of them:
residual add + RMSNorm, SwiGLU (q/k RMSNorm + RoPE + the K/V cache write are attention.py's). Every intermediate is
rounded to the model dtype where the reference rounds it (`rounded`), so the fused path follows the reference's
arithmetic.
`TRITON_INTERPRET=1` runs them on the CPU for the tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dependent_launch import dependent_launch, wait_for_inputs


@triton.jit
def rounded(x, DTYPE: tl.constexpr):
    """Round an fp32 value to the model dtype and back, as a PyTorch op on model-dtype tensors would."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def roped(x, mate, first_half, cos, sin, DTYPE: tl.constexpr):
    """apply_rope of fp32 values x: x * cos + rotate_half(x) * sin, rounded as PyTorch rounds it; `mate` holds each
    value's partner in the other half of its head, negated where `first_half`."""
    return rounded(rounded(x * cos, DTYPE) + rounded(tl.where(first_half, -mate, mate) * sin, DTYPE), DTYPE)


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
            delta = rounded(delta * tl.load(scale_ptr + cols, mask=mask, other=0.0).to(tl.float32), dtype)
        x = rounded(x + delta, dtype)
        tl.store(residual_ptr + row * size + cols, x.to(dtype), mask=mask)
    normalised = rounded(x * tl.rsqrt(tl.sum(x * x, axis=0) / size + eps), dtype)
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
def _silu_mul_kernel(gate_up_ptr, out_ptr, size, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * 2 * size + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * size + size + cols, mask=mask, other=0.0).to(tl.float32)
    activated = rounded(gate * tl.sigmoid(gate), dtype)
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
