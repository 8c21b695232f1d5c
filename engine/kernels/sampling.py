"""The whole draw of one code in one Triton kernel: temperature, top-k, top-p, counter-based Gumbel noise, argmax.

`sampling.choose` is the PyTorch definition (two sorts and ~70 small kernels per draw, 16 draws per frame); this
kernel gives the same ids in one launch per draw. It needs no sort: the top-k and top-p cut-offs are found by
building the threshold bit by bit over the order-preserving integer image of the float logits (a masked reduction
per bit), which lands exactly on the value the sorted definition picks, ties included. The noise is the same hash of
(seed, counter, token) as `sampling.gumbel_noise`, in uint32 arithmetic.

The top-k search runs over the logits as the model wrote them, before the temperature: their dtype leaves the low
bits of the float32 image zero (16 of them in bf16), so only the others need a pass each, half the passes of a
search over the divided values (the draw is 16 of a frame step's kernels). Division by a positive temperature keeps
the order, so the k-th largest divided value is the divided k-th largest logit, and `x >= that` is the reference's
set exactly, also where the division makes neighbours equal.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dependent_launch import dependent_launch, wait_for_inputs

from engine.sampling import SamplerBatch


@triton.jit
def _mix32(x):
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _ordered_keys(x):
    """float32 -> uint32 with the same order (negative floats flipped, positive ones above them).

    The flip is `bits ^ 0xFFFFFFFF` with a typed uint32 constant, not `~bits`: the interpreter of Triton 3.8 (the
    one torch 2.14 pins) builds `~`'s all-ones operand as numpy's uint32(-1), which numpy 2 rejects with
    OverflowError. Both spell the same xor on the GPU."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)  # -0.0 is +0.0: equal values, one key
    return tl.where((bits >> 31) == 1, bits ^ tl.full((), 0xFFFFFFFF, tl.uint32), bits | 0x80000000)


@triton.jit
def _largest_key(keys, valid, weights, limit, AT_LEAST: tl.constexpr, BITS: tl.constexpr = 32):
    """The largest t with count(keys >= t) >= limit (AT_LEAST), or with sum(weights of keys < t) <= limit. Only the
    top `BITS` bits are searched: the keys' lower bits must be all equal (all 0 or all 1) within each key."""
    answer = tl.zeros((), tl.uint32)
    for bit in tl.static_range(BITS):
        candidate = answer | tl.full((), 1 << (31 - bit), tl.uint32)
        if AT_LEAST:
            ok = tl.sum((valid & (keys >= candidate)).to(tl.int32), axis=0) >= limit
        else:
            ok = tl.sum(tl.where(valid & (keys < candidate), weights, 0.0), axis=0) <= limit
        answer = tl.where(ok, candidate, answer)
    return answer


@triton.jit
def _gumbel(seed, counter, cols):
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    row = _mix32(_mix32(seed_lo) ^ seed_hi)
    row = _mix32(row ^ _mix32((counter & 0xFFFFFFFF).to(tl.uint32)))
    bits = _mix32(row ^ (cols.to(tl.uint32) * 0x27D4EB2F)) >> 9
    uniform = (bits.to(tl.float32) + 0.5) / 8388608.0
    return -tl.log(-tl.log(uniform))


@triton.jit
def _sample_kernel(logits_ptr, stride_row, vocab, out_ptr, do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr,
                   seeds_ptr, frame_ptr, group, GROUPS: tl.constexpr, BLOCK: tl.constexpr, KEY_BITS: tl.constexpr,
                   PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < vocab
    logits = tl.load(logits_ptr + row * stride_row + cols, mask=valid, other=float("-inf")).to(tl.float32)
    chosen = tl.argmax(logits, axis=0)
    if tl.load(do_sample_ptr + row) != 0:
        x = logits / tl.load(temperature_ptr + row)
        keep = valid
        top_k = tl.load(top_k_ptr + row)
        if (top_k > 0) & (top_k < vocab):
            model_keys = _ordered_keys(logits)
            kth_logit = _largest_key(model_keys, valid, x, top_k.to(tl.int32), True, KEY_BITS)
            kth = tl.min(tl.where(valid & (model_keys >= kth_logit), x, float("inf")), axis=0)
            keep = keep & (x >= kth)
            x = tl.where(keep, x, float("-inf"))
        top_p = tl.load(top_p_ptr + row)
        if top_p < 1.0:
            keys = _ordered_keys(x)
            weights = tl.where(keep, tl.exp(x - tl.max(x, axis=0)), 0.0)
            weights = weights / tl.sum(weights, axis=0)
            cut = _largest_key(keys, keep, weights, 1.0 - top_p, False)
            cut = tl.minimum(cut, tl.max(tl.where(keep, keys, 0), axis=0))
            keep = keep & (keys >= cut)
        counter = tl.load(frame_ptr + row) * GROUPS + group
        noisy = tl.where(keep, x + _gumbel(tl.load(seeds_ptr + row), counter, cols), float("-inf"))
        chosen = tl.argmax(noisy, axis=0)
    tl.store(out_ptr + row, chosen.to(tl.int64))


# bits of a logit's float32 image that can differ, by the dtype the model writes its logits in
KEY_BITS = {torch.bfloat16: 16, torch.float16: 19, torch.float32: 32}


def fused_choose(logits: torch.Tensor, params: SamplerBatch, seeds: torch.Tensor, frame_index: torch.Tensor,
                 group: int, groups: int = 16) -> torch.Tensor:
    """The ids `sampling.choose` picks for logits [B, V] with counters draw_counter(frame_index, group)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    block = triton.next_power_of_2(vocab)
    pdl = dependent_launch(logits.device)
    _sample_kernel[(rows,)](logits, logits.stride(0), vocab, out, params.do_sample, params.temperature,
                            params.top_k, params.top_p, seeds, frame_index, group, GROUPS=groups, BLOCK=block,
                            KEY_BITS=KEY_BITS[logits.dtype], PDL=pdl, num_warps=8 if block >= 2048 else 4,
                            launch_pdl=pdl)
    return out
