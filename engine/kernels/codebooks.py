"""Every codebook's lookup of a frame and their sums in one kernel: the start of the codec decoder's call.

The decoder turns a frame's 16 codes into two sums of codebook vectors (the first codebook's alone, then the other
15's), each followed by its 1x1 projection. As PyTorch ops that is a clamp, 16 embedding lookups and 15 adds: ~32
launches of a few microseconds each, 40-70 us of a ~1 ms one-frame call (docs/benchmarks.md). Here one program
per frame loads its codes, clamps them, gathers their vectors and sums them in the reference's order, rounding each
partial sum to the model's dtype as a PyTorch add on model-dtype tensors does, so the sums are the plain path's bits
wherever the dtype rounds to nearest (the GPU; Triton's interpreter truncates bf16). `TRITON_INTERPRET=1` runs it on
the CPU for the tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _codebook_sums_kernel(codes_ptr, books_ptr, first_ptr, rest_ptr, frames_per_row, size, dim,
                          stride_cb, stride_cn, stride_cq, BOOKS: tl.constexpr, FIRST: tl.constexpr,
                          BLOCK: tl.constexpr):
    frame = tl.program_id(0)
    dims = tl.arange(0, BLOCK)
    mask = dims < dim
    dtype = first_ptr.dtype.element_ty
    codes = codes_ptr + (frame // frames_per_row) * stride_cb + (frame % frames_per_row) * stride_cn
    first = tl.zeros([BLOCK], tl.float32)
    rest = tl.zeros([BLOCK], tl.float32)
    for book in tl.static_range(BOOKS):
        code = tl.maximum(tl.load(codes + book * stride_cq), 0).to(tl.int64)
        vector = tl.load(books_ptr + (book * size + code) * dim + dims, mask=mask, other=0.0).to(tl.float32)
        if book < FIRST:
            first = (first + vector).to(dtype).to(tl.float32)
        else:
            rest = (rest + vector).to(dtype).to(tl.float32)
    tl.store(first_ptr + frame * dim + dims, first.to(dtype), mask=mask)
    tl.store(rest_ptr + frame * dim + dims, rest.to(dtype), mask=mask)


def codebook_sums(codes: torch.Tensor, books: torch.Tensor, first_books: int) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [B, n, Q] (negative codes read as 0; each below the codebook size), books [Q, size, dim] -> the sums of
    codebooks [0, first_books) and [first_books, Q), each [B, dim, n] (stored as [B, n, dim], the layout the plain
    path's sums have). fp32 or a 16-bit float: the sums run in fp32, rounded to the books' dtype."""
    batch, frames, count = codes.shape
    size, dim = books.shape[1:]
    assert books.shape[0] == count and books.is_contiguous() and 0 < first_books < count
    assert books.dtype in (torch.float32, torch.bfloat16, torch.float16)
    sums = torch.empty(2, batch, frames, dim, dtype=books.dtype, device=books.device)
    if batch * frames:
        _codebook_sums_kernel[(batch * frames,)](
            codes, books, sums[0], sums[1], frames, size, dim, codes.stride(0), codes.stride(1), codes.stride(2),
            BOOKS=count, FIRST=first_books, BLOCK=triton.next_power_of_2(dim))
    return sums[0].transpose(1, 2), sums[1].transpose(1, 2)
