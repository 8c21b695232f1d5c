"""Host tensors up to the device without waiting for it."""
from __future__ import annotations

import torch


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`. A plain copy from pageable host memory waits until the GPU has run everything queued
    before it; from pinned memory it is queued like a kernel, so the host goes on (the caching host allocator keeps
    the pinned block until the copy has run)."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
