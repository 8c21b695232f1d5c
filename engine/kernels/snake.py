"""SnakeBeta fused with the causal padding of the convolution that reads it, for the codec decoder on a GPU.

The codec decoder's upsampling stack applies SnakeBeta (`x + 1/beta * sin(alpha * x)^2`) 29 times to its largest
activations, and each time the next causal convolution prepends the inputs it remembers (`cat(past, x)`). In PyTorch
that is ten kernels over the whole activation (five of them full-size passes, and the concatenation); here it is one
pass that reads `x` and the remembered columns once and writes the padded convolution input. Every intermediate is
rounded to the model dtype where the reference rounds it (`_rounded`), so the result follows the reference's
arithmetic. `TRITON_INTERPRET=1` runs it on the CPU for the tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.layer_ops import _rounded

MAX_BLOCK = 1024  # time columns per program; a row shorter than that gets one program of its own size


@triton.jit
def _snake_padded_kernel(x_ptr, past_ptr, alpha_ptr, beta_ptr, out_ptr, channels, frames, context,
                         stride_xb, stride_xc, HAS_PAST: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # one (batch, channel) row
    batch, channel = row // channels, row % channels
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    total = context + frames
    dtype = out_ptr.dtype.element_ty
    alpha = _rounded(tl.exp(tl.load(alpha_ptr + channel).to(tl.float32)), dtype)
    beta = _rounded(_rounded(tl.exp(tl.load(beta_ptr + channel).to(tl.float32)), dtype) + 1e-9, dtype)
    inverse_beta = _rounded(1.0 / beta, dtype)
    is_new = (cols >= context) & (cols < total)
    x = tl.load(x_ptr + batch * stride_xb + channel * stride_xc + (cols - context), mask=is_new,
                other=0.0).to(tl.float32)
    sine = _rounded(tl.sin(_rounded(x * alpha, dtype)), dtype)
    activated = _rounded(x + _rounded(inverse_beta * _rounded(sine * sine, dtype), dtype), dtype)
    if HAS_PAST:
        remembered = tl.load(past_ptr + row * context + cols, mask=cols < context, other=0.0).to(tl.float32)
    else:
        remembered = tl.zeros([BLOCK], dtype=tl.float32)
    tl.store(out_ptr + row * total + cols, tl.where(is_new, activated, remembered).to(dtype), mask=cols < total)


def snake_padded(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, past: torch.Tensor | None,
                 context: int) -> torch.Tensor:
    """cat(past, SnakeBeta(x)) along time: x [B, C, n] (unit stride in time), past [B, C, context] or None (zeros),
    alpha and beta [C] (log-scale, as stored) -> [B, C, context + n], contiguous."""
    batch, channels, frames = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if past is not None:
        past = past.contiguous()
    out = torch.empty(batch, channels, context + frames, dtype=x.dtype, device=x.device)
    block = min(MAX_BLOCK, triton.next_power_of_2(context + frames))
    grid = (batch * channels, triton.cdiv(context + frames, block))
    _snake_padded_kernel[grid](x, x if past is None else past, alpha, beta, out, channels, frames, context,
                               x.stride(0), x.stride(1), HAS_PAST=past is not None, BLOCK=block)
    return out
