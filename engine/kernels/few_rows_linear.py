"""A linear layer for one row (a lone request's token in the frame step) with its neighbours fused in: the RMSNorm
before it, the SwiGLU before the down projection, the residual add after it.

At one row every matmul of a transformer block reads its weights once and does almost no arithmetic, so a block
costs its launches: cuBLAS's GEMV plus its split-K reduction, and a kernel each for the norm, the activation and the
add. Here one program owns `BLOCK_N` output features and streams their weight rows over the whole input (no split of
K, so the epilogue can finish the row itself), its products summed per lane and reduced once at the end: the norm is
computed by every program from the input row it reads anyway (a few KB from L2), the activation on load, the residual
add on store. A block of the step is then 6 launches instead of 9-12. Each output is one fixed-order reduction of its
own row against its weights, the same whatever the other rows are (PROTOCOL.md's seed guarantee). Rounding follows the
reference: the normalised input, its weighted value, the activation, the product, the layer's output and the sum are
each rounded to the model's dtype where the PyTorch code rounds them. `TRITON_INTERPRET=1` runs it on the CPU.

Several rows a program (`rows_per_program`) share each weight tile; measured slower than cuBLAS and the separate
kernels from 4 rows up (docs/benchmarks.md), so the engine uses it for a row or two (`fused_layers`).
A `tl.dot` form, 16 rows a program, was 2-4x slower still at every batch and is gone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dependent_launch import dependent_launch, wait_for_inputs

PLAIN = tl.constexpr(0)  # what is applied to the input as it is loaded
NORM = tl.constexpr(1)
SWIGLU = tl.constexpr(2)
# the fastest output block for one row on the H100 (`scripts/bench_linear.py --per-op`); the CPU's interpreter pays
# per program instead, so there a program takes many more outputs (each output's sum is the same either way)
GPU_BLOCK_N = 8
INTERPRETED_BLOCK_N = 256


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _few_rows_linear_kernel(x_ptr, weight_ptr, bias_ptr, norm_ptr, residual_ptr, out_ptr,
                            rows, features, width, stride_x, stride_out, eps,
                            INPUT: tl.constexpr, HAS_BIAS: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
                            ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    dtype = weight_ptr.dtype.element_ty
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # row blocks of one weight tile run side by side (L2)
    row_mask = row < rows
    col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = col < features
    if INPUT == NORM:  # the row's mean square first, in fp32
        squares = tl.zeros([ROWS], tl.float32)
        for start in range(0, width, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row[:, None] * stride_x + k[None, :],
                        mask=row_mask[:, None] & (k[None, :] < width), other=0.0).to(tl.float32)
            squares += tl.sum(x * x, axis=1)
        inv_rms = tl.rsqrt(squares / width + eps)
    lanes = tl.zeros([ROWS, BLOCK_N, BLOCK_K], tl.float32)
    for start in range(0, width, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        k_mask = k < width
        x_mask = row_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptr + row[:, None] * stride_x + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
        if INPUT == NORM:
            scale = tl.load(norm_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
            x = scale[None, :] * _rounded(x * inv_rms[:, None], dtype)
        elif INPUT == SWIGLU:  # x is the gate, the up projection `width` columns to its right
            up = tl.load(x_ptr + row[:, None] * stride_x + width + k[None, :], mask=x_mask, other=0.0)
            x = _rounded(x * tl.sigmoid(x), dtype) * up.to(tl.float32)
        w = tl.load(weight_ptr + col[:, None] * width + k[None, :], mask=col_mask[:, None] & k_mask[None, :],
                    other=0.0)
        lanes += _rounded(x, dtype)[:, None, :] * w.to(tl.float32)[None, :, :]
    acc = tl.sum(lanes, axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = _rounded(acc, dtype)
    out_mask = row_mask[:, None] & col_mask[None, :]
    if ADD_RESIDUAL:
        target = residual_ptr + row[:, None] * stride_out + col[None, :]
        out = tl.load(target, mask=out_mask, other=0.0).to(tl.float32) + out
        tl.store(target, out.to(dtype), mask=out_mask)
    else:
        tl.store(out_ptr + row[:, None] * stride_out + col[None, :], out.to(dtype), mask=out_mask)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    norm: torch.Tensor | None = None, eps: float = 1e-6, swiglu: bool = False,
                    residual: torch.Tensor | None = None, block_n: int | None = None, block_k: int = 1024,
                    warps: int = 4, stages: int = 1, rows_per_program: int = 1) -> torch.Tensor:
    """F.linear(f(x), weight, bias) for x [N, K] (unit stride in K), weight [F, K] (contiguous), where f is
    RMSNorm with weights `norm` (x = the residual stream), or SwiGLU (`swiglu`: x [N, 2K] = gate then up), or nothing.
    With `residual` [N, F] the output is added to it in place and `residual` is returned; else a new [N, F].
    The defaults are the fastest blocks for one row on the H100 (`scripts/bench_linear.py --per-op`)."""
    block_n = block_n or (GPU_BLOCK_N if x.is_cuda else INTERPRETED_BLOCK_N)
    assert not (swiglu and norm is not None)
    rows, features = x.shape[0], weight.shape[0]
    width = weight.shape[1]
    assert x.shape[1] == (2 * width if swiglu else width) and x.stride(1) == 1 and weight.is_contiguous()
    out = residual if residual is not None else torch.empty(rows, features, dtype=weight.dtype, device=x.device)
    assert out.shape == (rows, features) and out.stride(1) == 1
    grid = (triton.cdiv(rows, rows_per_program), triton.cdiv(features, block_n))
    pdl = dependent_launch(x.device)
    _few_rows_linear_kernel[grid](
        x, weight, bias if bias is not None else weight, norm if norm is not None else weight, out, out,
        rows, features, width, x.stride(0), out.stride(0), eps,
        INPUT=(NORM if norm is not None else SWIGLU if swiglu else PLAIN).value, HAS_BIAS=bias is not None,
        ADD_RESIDUAL=residual is not None, ROWS=rows_per_program, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl,
        num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return out
