"""Rows of a pool copied by index, all in one launch: the decoder pool's per-slot states in and out of a decode call.

A slot's whole codec-decoder state (38 tensors: conv histories, the transformer's key and value windows) is one row
of the pool, so a call gathers its requests' states with one kernel and scatters them back with another, where a
gather and a scatter per tensor were 76 launches of PyTorch's indexing kernels (~0.24 ms of a 1.3 ms one-frame call
on an H100, ~1.2 ms of a 128 x 4 one: docs/benchmarks.md). `TRITON_INTERPRET=1` runs it on the CPU for the tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements a program copies


@triton.jit
def _copy_rows_kernel(source_ptr, source_rows_ptr, target_ptr, target_rows_ptr, columns, source_stride,
                      target_stride, BLOCK: tl.constexpr):
    row = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < columns
    source_row = tl.load(source_rows_ptr + row).to(tl.int64)
    target_row = tl.load(target_rows_ptr + row).to(tl.int64)
    values = tl.load(source_ptr + source_row * source_stride + cols, mask=mask)
    tl.store(target_ptr + target_row * target_stride + cols, values, mask=mask)


def copy_rows(source: torch.Tensor, source_rows: torch.Tensor, target: torch.Tensor, target_rows: torch.Tensor
              ) -> None:
    """target[target_rows[i]] = source[source_rows[i]] for every i: 2-D tensors of one dtype and width, unit stride
    along a row; the row indices int64 on the same device. A row named twice in `target_rows` gets a mix of its
    sources (the pool's scratch slot, whose state nobody reads)."""
    assert source.shape[1] == target.shape[1] and source.stride(1) == target.stride(1) == 1
    assert source.dtype == target.dtype and len(source_rows) == len(target_rows)
    if not len(source_rows):
        return
    columns = source.shape[1]
    _copy_rows_kernel[(triton.cdiv(columns, BLOCK), len(source_rows))](
        source, source_rows, target, target_rows, columns, source.stride(0), target.stride(0), BLOCK=BLOCK)
