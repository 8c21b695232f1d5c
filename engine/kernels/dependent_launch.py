"""Programmatic dependent launch (PDL, Hopper and later) for the frame step's chain of small kernels.

At one row a frame step is ~1,100 kernels in sequence of a few microseconds each, and even in a CUDA graph the GPU
drains one grid before it starts the next. A kernel launched with PDL starts while the one before it finishes: its
programs fetch what no earlier kernel writes (a matmul's first weight tile), then wait (`gdc_wait`) until the
kernel before has completed and its writes are visible, and from then on let the next kernel start. Every kernel of
the chain waits before it reads or writes activations, so the order of their effects is the stream's order; a kernel
launched without PDL (cuBLAS, PyTorch) waits for everything before it, as always. Set `VOXGATE_DEPENDENT_LAUNCH=0`
to launch as before (the benchmark's before/after). The interpreter and GPUs before Hopper launch plainly.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait until the kernel before this one has completed (its writes visible); then let the next one start."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (pass it as both the kernel's `PDL` and `launch_pdl`)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("VOXGATE_DEPENDENT_LAUNCH", "1") == "0":
        return False
    return _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())
