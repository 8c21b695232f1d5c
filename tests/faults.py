"""Fault injection for the engine tests: `inject_faults` is an engine setup hook (`EngineSpec.setup`,
`GatewayOptions.engine_setup`; a top-level function, so the engine process can run it too) after which one stage of
a request raises when the request's text names that stage: TOKENIZE_FAULT, PROMPT_FAULT, PREFILL_FAULT, STEP_FAULT,
DECODE_FAULT; DEVICE_FAULT raises a CUDA-like error in the step, STALL makes the step hang, STEPS_BROKEN makes every
step raise while that request is in the engine."""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.core.engine import Engine

TOKENIZE = "TOKENIZEFAULT"
PROMPT = "PROMPTFAULT"
PREFILL = "PREFILLFAULT"
STEP = "STEPFAULT"
DECODE = "DECODEFAULT"
DEVICE = "DEVICEFAULT"
STALL = "STALLFAULT"
STEPS_BROKEN = "STEPSBROKEN"
STALL_S = 60.0


class InjectedFault(RuntimeError):
    """What an injected stage raises: an unexpected exception, as a bug would raise."""


def inject_faults(engine: Engine) -> None:
    """Instrument `engine` (its own copy of the model object, so that other engines sharing it are untouched); one
    intra-op thread, as the test process runs with (`one_thread`), so that both give the same numbers."""
    torch.set_num_threads(1)
    tts = engine.tts = copy.copy(engine.tts)
    tts.tokenizer = copy.copy(tts.tokenizer)
    tts.tokenizer.plain = _Tokenizer(tts.tokenizer.plain)  # what reads a client's text, whole or in pieces
    tts.prompt_from_ids = _checked(tts.prompt_from_ids, lambda ids, *_: _raise_if(PROMPT, _decode(tts, ids)))
    runner, decoders = engine.runner, engine.decoding.decoders
    runner.prefill = _checked(runner.prefill, lambda seqs: _raise_for(engine, PREFILL, [s.slot for s in seqs]))
    decoders.decode = _checked(decoders.decode, lambda slots, _: _raise_for(engine, DECODE, slots))
    runner.run = _checked(runner.run, lambda batch: _step_faults(engine, batch.slots.tolist()))


def _checked(function: Callable, check: Callable) -> Callable:
    def checked(*args: Any, **kwargs: Any) -> Any:
        check(*args, **kwargs)
        return function(*args, **kwargs)

    return checked


def _step_faults(engine: Engine, slots: list[int]) -> None:
    if any(STEPS_BROKEN in _text(seq) for seq in engine.running.values()):
        raise InjectedFault("every step fails")
    _raise_for(engine, STEP, slots)
    if _marked(engine, DEVICE, slots):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered (injected)")
    if _marked(engine, STALL, slots):
        time.sleep(STALL_S)


def _raise_for(engine: Engine, marker: str, slots: list[int]) -> None:
    if _marked(engine, marker, slots):
        raise InjectedFault(f"injected: {marker}")


def _marked(engine: Engine, marker: str, slots: list[int]) -> bool:
    return any(seq.slot in slots and marker in _text(seq) for seq in engine.running.values())


def _text(seq) -> str:
    return seq.feed.text if seq.feed is not None else seq.request.text


def _decode(tts, ids: list[int]) -> str:
    return tts.tokenizer.tokenizer.decode(ids)


def _raise_if(marker: str, text: str) -> None:
    if marker in text:
        raise InjectedFault(f"injected: {marker}")


class _Tokenizer:
    """A `tokenizers.Tokenizer` that raises for text naming TOKENIZE, in whole or in pieces (streaming)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def encode(self, text: str, *args: Any, **kwargs: Any) -> Any:
        _raise_if(TOKENIZE, text)
        return self._inner.encode(text, *args, **kwargs)
