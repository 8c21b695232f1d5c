"""The codec decoder's elementwise work around its convolutions, each one pass over the activation, on a GPU.

Before a convolution: the upsampling stack applies SnakeBeta (`x + 1/beta * sin(alpha * x)^2`) 29 times to its
largest activations, and each time the next causal convolution prepends the inputs it remembers (`cat(past, x)`). In
PyTorch that is ten kernels over the whole activation (five of them full-size passes, and the concatenation); here
it is one pass that reads `x` and the remembered columns once and writes the padded convolution input
(`snake_padded`), adding the bias of the convolution that made `x` on the way. A convolution that no SnakeBeta
precedes gets its padding here too. After one: its bias and the residual in one pass (`add_bias_residual`), where
PyTorch's bias add (a broadcast: its slow, non-vectorised kernel) and the residual add were two.

Every intermediate is rounded to the model dtype where PyTorch rounds it (`_rounded`), so the result follows the
reference's arithmetic. The outputs are written channels-minor when asked ([B, C, T] with channel stride 1, the
memory of [B, T, C]): cuDNN's convolutions on the GPU run in that layout without converting to it and back
(docs/benchmarks.md). Inputs may come in any strides. `TRITON_INTERPRET=1` runs them on the CPU for the tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.attention import MIN_DOT
from engine.kernels.layer_ops import _rounded

TILE = 4096  # elements a program writes: BLOCK_T time columns by BLOCK_C channels
MAX_BLOCK_C = 64
# `snake_pointwise_residual`'s tiles: rows (batch x time), output channels, input channels a step; the fastest of 21
# configurations at the decoder's shapes on an H100 (docs/benchmarks.md)
POINTWISE_BLOCK_M = 64 * 2
MAX_BLOCK_N = 128
POINTWISE_BLOCK_K = 32
POINTWISE_WARPS, POINTWISE_STAGES = 8, 3


@triton.jit
def _snake_beta(x, alpha_ptr, beta_ptr, chans, channels, dtype: tl.constexpr):
    """SnakeBeta of x (fp32 values of the model dtype) for channels `chans` (broadcast against x), rounded where
    PyTorch rounds."""
    alpha = _rounded(tl.exp(tl.load(alpha_ptr + chans, mask=chans < channels, other=0.0).to(tl.float32)), dtype)
    beta = tl.load(beta_ptr + chans, mask=chans < channels, other=0.0).to(tl.float32)
    beta = _rounded(_rounded(tl.exp(beta), dtype) + 1e-9, dtype)
    inverse_beta = _rounded(1.0 / beta, dtype)
    sine = _rounded(tl.sin(_rounded(x * alpha, dtype)), dtype)
    return _rounded(x + _rounded(inverse_beta * _rounded(sine * sine, dtype), dtype), dtype)


@triton.jit
def _padded_kernel(x_ptr, past_ptr, bias_ptr, alpha_ptr, beta_ptr, out_ptr, tail_ptr, channels, frames, context,
                   x_sb, x_sc, x_st, past_sb, past_sc, past_st, out_sb, out_sc, out_st, tail_sb, tail_sc, tail_st,
                   HAS_BIAS: tl.constexpr, ACTIVATE: tl.constexpr, HAS_PAST: tl.constexpr, HAS_TAIL: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None]
    batch = tl.program_id(1)
    chans = (tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    total = context + frames
    dtype = out_ptr.dtype.element_ty
    in_range = (chans < channels) & (cols < total)
    is_new = in_range & (cols >= context)
    x = tl.load(x_ptr + batch * x_sb + chans * x_sc + (cols - context) * x_st, mask=is_new,
                other=0.0).to(tl.float32)
    if HAS_BIAS:
        x = _rounded(x + tl.load(bias_ptr + chans, mask=chans < channels, other=0.0).to(tl.float32), dtype)
    if ACTIVATE:
        x = _snake_beta(x, alpha_ptr, beta_ptr, chans, channels, dtype)
    if HAS_PAST:
        remembered = tl.load(past_ptr + batch * past_sb + chans * past_sc + cols * past_st,
                             mask=in_range & (cols < context), other=0.0).to(tl.float32)
    else:
        remembered = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    padded = tl.where(is_new, x, remembered).to(dtype)
    tl.store(out_ptr + batch * out_sb + chans * out_sc + cols * out_st, padded, mask=in_range)
    if HAS_TAIL:  # the next call's past: the last `context` columns
        tail_cols = cols - frames
        tl.store(tail_ptr + batch * tail_sb + chans * tail_sc + tail_cols * tail_st, padded,
                 mask=in_range & (tail_cols >= 0))


@triton.jit
def _bias_residual_kernel(residual_ptr, x_ptr, bias_ptr, out_ptr, channels, frames, r_sb, r_sc, r_st,
                          x_sb, x_sc, x_st, out_sb, out_sc, out_st, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None]
    batch = tl.program_id(1)
    chans = (tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    dtype = out_ptr.dtype.element_ty
    mask = (chans < channels) & (cols < frames)
    x = tl.load(x_ptr + batch * x_sb + chans * x_sc + cols * x_st, mask=mask, other=0.0).to(tl.float32)
    biased = _rounded(x + tl.load(bias_ptr + chans, mask=chans < channels, other=0.0).to(tl.float32), dtype)
    residual = tl.load(residual_ptr + batch * r_sb + chans * r_sc + cols * r_st, mask=mask, other=0.0)
    tl.store(out_ptr + batch * out_sb + chans * out_sc + cols * out_st,
             (residual.to(tl.float32) + biased).to(dtype), mask=mask)


@triton.jit
def _snake_pointwise_residual_kernel(h_ptr, in_bias_ptr, alpha_ptr, beta_ptr, weight_ptr, bias_ptr, residual_ptr,
                                     out_ptr, rows, frames, channels, h_sb, h_sc, h_st, w_so, w_si, r_sb, r_sc, r_st,
                                     out_sb, out_sc, out_st, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (batch, time) flattened
    batch, col = row // frames, row % frames
    row_mask = (row < rows)[:, None]
    outs = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, channels, BLOCK_K):
        ins = start + tl.arange(0, BLOCK_K)
        in_mask = ins < channels
        h = tl.load(h_ptr + (batch * h_sb + col * h_st)[:, None] + ins[None, :] * h_sc,
                    mask=row_mask & in_mask[None, :], other=0.0).to(tl.float32)
        h = _rounded(h + tl.load(in_bias_ptr + ins, mask=in_mask, other=0.0).to(tl.float32)[None, :], dtype)
        activated = _snake_beta(h, alpha_ptr, beta_ptr, ins[None, :], channels, dtype).to(dtype)
        weight = tl.load(weight_ptr + outs * w_so + ins[:, None] * w_si,
                         mask=(outs < channels) & in_mask[:, None], other=0.0)
        acc = tl.dot(activated, weight, acc, input_precision=PRECISION)
    mask = row_mask & (outs < channels)
    biased = _rounded(_rounded(acc, dtype) + tl.load(bias_ptr + outs, mask=outs < channels, other=0.0).to(tl.float32),
                      dtype)
    residual = tl.load(residual_ptr + (batch * r_sb + col * r_st)[:, None] + outs * r_sc, mask=mask, other=0.0)
    tl.store(out_ptr + (batch * out_sb + col * out_st)[:, None] + outs * out_sc,
             (residual.to(tl.float32) + biased).to(dtype), mask=mask)


def snake_padded(x: torch.Tensor, alpha: torch.Tensor | None, beta: torch.Tensor | None, past: torch.Tensor | None,
                 context: int, channels_minor: bool = False, bias: torch.Tensor | None = None,
                 tail: torch.Tensor | None = None) -> torch.Tensor:
    """cat(past, SnakeBeta(x + bias)) along time: x [B, C, n], past [B, C, context] or None (zeros), alpha and beta
    [C] (log-scale, as stored; None: no activation, the padding alone), bias [C] or None -> [B, C, context + n],
    dense: channels-minor if `channels_minor`, else time-minor (contiguous). `tail` [B, C, context] in any strides,
    if given, gets a copy of the result's last `context` columns (the next call's past: the decoder pool's rows)."""
    batch, channels, frames = x.shape
    out = _dense(x, batch, channels, context + frames, channels_minor)
    past_strides = (0, 0, 0) if past is None else past.stride()
    tail_strides = (0, 0, 0) if tail is None else tail.stride()
    _padded_kernel[_grid(batch, channels, context + frames)](
        x, _or(past, x), _or(bias, x), _or(alpha, x), _or(beta, x), out, _or(tail, out), channels, frames, context,
        *x.stride(), *past_strides, *out.stride(), *tail_strides, HAS_BIAS=bias is not None,
        ACTIVATE=alpha is not None, HAS_PAST=past is not None, HAS_TAIL=tail is not None,
        **_blocks(channels, context + frames))
    return out


def add_bias_residual(residual: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """residual + (x + bias), rounded as PyTorch rounds the two adds: residual and x [B, C, n] in any strides, bias
    [C] -> [B, C, n] in x's layout (channels-minor or contiguous)."""
    batch, channels, frames = x.shape
    out = _dense(x, batch, channels, frames, x.stride(1) < x.stride(2))
    _bias_residual_kernel[_grid(batch, channels, frames)](
        residual, x, bias, out, channels, frames, *residual.stride(), *x.stride(), *out.stride(),
        **_blocks(channels, frames))
    return out


def snake_pointwise_residual(residual: torch.Tensor, hidden: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                             input_bias: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """residual + (conv(SnakeBeta(hidden + input_bias)) + bias) for a 1x1 convolution `weight` [C, C, 1]: a residual
    unit's second half as one matrix product over the (batch, time) rows, its input's bias and activation applied
    as the tiles load and its bias and residual added as they store. Three passes over the activation where the
    padding kernel, cuDNN and `add_bias_residual` took seven. hidden and residual [B, C, n] in any strides -> [B, C, n]
    in hidden's layout. Rounded as the separate kernels round, save the sum's order (fp32: full precision, not
    TF32). Faster than the separate kernels only where `pointwise_fits`."""
    batch, channels, frames = hidden.shape
    out = _dense(hidden, batch, channels, frames, hidden.stride(1) < hidden.stride(2))
    matrix = weight[:, :, 0]
    block_n = min(MAX_BLOCK_N, max(MIN_DOT, triton.next_power_of_2(channels)))
    grid = (triton.cdiv(batch * frames, POINTWISE_BLOCK_M), triton.cdiv(channels, block_n))
    _snake_pointwise_residual_kernel[grid](
        hidden, input_bias, alpha, beta, matrix, bias, residual, out, batch * frames, frames, channels,
        *hidden.stride(), *matrix.stride(), *residual.stride(), *out.stride(),
        PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32", BLOCK_M=POINTWISE_BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=POINTWISE_BLOCK_K, num_warps=POINTWISE_WARPS, num_stages=POINTWISE_STAGES)
    return out


def pointwise_fits(channels: int) -> bool:
    """Whether one program's tile holds every output channel, so that each input value is loaded and activated once.
    With more channels each tile of outputs loads and activates the input again, and cuDNN's convolution with the
    separate kernels is faster (H100: 1.05x at 192 channels, 2.3x at 768; the fused kernel 1.8x faster at 96)."""
    return channels <= MAX_BLOCK_N


def _dense(like: torch.Tensor, batch: int, channels: int, columns: int, channels_minor: bool) -> torch.Tensor:
    if channels_minor:
        return torch.empty(batch, columns, channels, dtype=like.dtype, device=like.device).transpose(1, 2)
    return torch.empty(batch, channels, columns, dtype=like.dtype, device=like.device)


def _blocks(channels: int, columns: int) -> dict[str, int]:
    block_c = min(MAX_BLOCK_C, triton.next_power_of_2(channels))
    return dict(BLOCK_T=min(TILE // block_c, triton.next_power_of_2(columns)), BLOCK_C=block_c)


def _grid(batch: int, channels: int, columns: int) -> tuple[int, int, int]:
    """Time tiles on the grid's first axis, the only one not limited to 65,535 programs: an offline decode of three
    minutes is 3.5 million columns of the last block, 54,000 tiles."""
    blocks = _blocks(channels, columns)
    return triton.cdiv(columns, blocks["BLOCK_T"]), batch, triton.cdiv(channels, blocks["BLOCK_C"])


def _or(tensor: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """A pointer for an argument the kernel does not read (its flag is off)."""
    return placeholder if tensor is None else tensor
