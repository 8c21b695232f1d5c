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

from engine.kernels.layer_ops import _rounded

TILE = 4096  # elements a program writes: BLOCK_T time columns by BLOCK_C channels
MAX_BLOCK_C = 64


@triton.jit
def _padded_kernel(x_ptr, past_ptr, bias_ptr, alpha_ptr, beta_ptr, out_ptr, channels, frames, context,
                   x_sb, x_sc, x_st, past_sb, past_sc, past_st, out_sb, out_sc, out_st, HAS_BIAS: tl.constexpr,
                   ACTIVATE: tl.constexpr, HAS_PAST: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
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
        alpha = _rounded(tl.exp(tl.load(alpha_ptr + chans, mask=chans < channels, other=0.0).to(tl.float32)), dtype)
        beta = tl.load(beta_ptr + chans, mask=chans < channels, other=0.0).to(tl.float32)
        beta = _rounded(_rounded(tl.exp(beta), dtype) + 1e-9, dtype)
        inverse_beta = _rounded(1.0 / beta, dtype)
        sine = _rounded(tl.sin(_rounded(x * alpha, dtype)), dtype)
        x = _rounded(x + _rounded(inverse_beta * _rounded(sine * sine, dtype), dtype), dtype)
    if HAS_PAST:
        remembered = tl.load(past_ptr + batch * past_sb + chans * past_sc + cols * past_st,
                             mask=in_range & (cols < context), other=0.0).to(tl.float32)
    else:
        remembered = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    tl.store(out_ptr + batch * out_sb + chans * out_sc + cols * out_st, tl.where(is_new, x, remembered).to(dtype),
             mask=in_range)


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


def snake_padded(x: torch.Tensor, alpha: torch.Tensor | None, beta: torch.Tensor | None, past: torch.Tensor | None,
                 context: int, channels_minor: bool = False, bias: torch.Tensor | None = None) -> torch.Tensor:
    """cat(past, SnakeBeta(x + bias)) along time: x [B, C, n], past [B, C, context] or None (zeros), alpha and beta
    [C] (log-scale, as stored; None: no activation, the padding alone), bias [C] or None -> [B, C, context + n],
    dense: channels-minor if `channels_minor`, else time-minor (contiguous)."""
    batch, channels, frames = x.shape
    out = _dense(x, batch, channels, context + frames, channels_minor)
    past_strides = (0, 0, 0) if past is None else past.stride()
    _padded_kernel[_grid(batch, channels, context + frames)](
        x, _or(past, x), _or(bias, x), _or(alpha, x), _or(beta, x), out, channels, frames, context, *x.stride(),
        *past_strides, *out.stride(), HAS_BIAS=bias is not None, ACTIVATE=alpha is not None,
        HAS_PAST=past is not None, **_blocks(channels, context + frames))
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
