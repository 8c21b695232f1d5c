"""Programmatic dependent launch (PDL, Hopper and later) for the frame step's chain of small kernels.

At one row a frame step is ~1,100 kernels in sequence of a few microseconds each, and even in a CUDA graph the GPU
drains one grid before it starts the next. A kernel launched with PDL may start while the one before it finishes: its
programs wait first (`gdc_wait`) until that kernel has completed and its writes are visible, and from then on let
the next kernel start. Every kernel of the chain waits before it reads or writes anything, so the order of their
effects is the stream's order; a kernel launched without PDL (cuBLAS, PyTorch) waits for everything before it, as
always. (Reading a matmul's first weight tile before the wait was measured no faster, and slower where PDL is off:
docs/benchmarks.md.) Set `VOXGATE_DEPENDENT_LAUNCH=0` to launch as before (the benchmark's before/after). Triton's
interpreter, ROCm and GPUs before Hopper launch plainly.
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
def _launches_dependently(index: int, interpreted: bool, switched_off: bool) -> bool:
    if interpreted or switched_off or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (pass it as both the kernel's `PDL` and `launch_pdl`)."""
    if device.type != "cuda":
        return False
    interpreted = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    switched_off = os.environ.get("VOXGATE_DEPENDENT_LAUNCH", "1") == "0"
    return _launches_dependently(device.index if device.index is not None else torch.cuda.current_device(),
                                 interpreted, switched_off)
