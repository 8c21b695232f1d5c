"""Failure isolation: whatever raises for a request fails that request alone, never the requests batched with it.

A batch that raises is bisected until the culprits are alone. Only a device fault (a CUDA error) is not isolated:
the device, not a request, is at fault, so it propagates and fails the engine.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from engine.errors import VoxgateError, request_failure

DEVICE_FAULT = getattr(torch, "AcceleratorError", ())  # a CUDA error: the device, not a request, is at fault
T = TypeVar("T")
R = TypeVar("R")


def request_error(error: Exception, stage: str) -> VoxgateError:
    """A request's failure as its typed error; a device fault is the engine's, so it propagates."""
    if isinstance(error, DEVICE_FAULT):
        raise error
    return request_failure(error, stage)


def isolated(items: list[T], run: Callable[[list[T]], R], stage: str, fail: Callable[[T, VoxgateError], None],
             retry: Callable[[list[T]], R] | None = None) -> list[tuple[list[T], R]]:
    """`run(items)` as one batch; if it raises, `retry` (default: `run`) on each half, recursively, so that only the
    items that fail alone end, through `fail(item, typed error)`. Returns each batch that ran, with its result."""
    if not items:
        return []
    try:
        return [(items, run(items))]
    except Exception as error:
        if isinstance(error, DEVICE_FAULT):
            raise
        if len(items) == 1:
            fail(items[0], request_failure(error, stage))
            return []
    retry = retry or run
    middle = len(items) // 2
    return isolated(items[:middle], retry, stage, fail) + isolated(items[middle:], retry, stage, fail)
