"""Load the official checkpoint layout into our modules, naming any missing or malformed file or tensor."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from engine.errors import CheckpointError

# Tensors the checkpoint carries that decoding never reads: the quantizer's encode-side projections.
UNUSED_DECODER_TENSORS = frozenset({"quantizer.rvq_first.input_proj.weight", "quantizer.rvq_rest.input_proj.weight"})


def read_tensors(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """All tensors under `prefix` (stripped) from a safetensors file."""
    if not path.is_file():
        raise CheckpointError(f"missing checkpoint file: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"malformed checkpoint file {path}: {exc}") from exc


def load_module(module: nn.Module, tensors: dict[str, torch.Tensor], source: str,
                is_unused: Callable[[str], bool] = lambda name: False) -> None:
    """Copy `tensors` into `module`'s parameters, requiring an exact match of names and shapes.

    `is_unused` names the checkpoint tensors the module knowingly does without; any other stray tensor means the
    file does not belong to this config."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(name for name in set(tensors) - set(expected) if not is_unused(name))
    if missing:
        raise CheckpointError(f"{source}: missing tensors {_few(missing)}")
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensors {_few(unexpected)} (wrong model type or size?)")
    for name, target in expected.items():
        if tensors[name].shape != target.shape:
            raise CheckpointError(f"{source}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                                  f"config.json implies {tuple(target.shape)}")
    module.load_state_dict({k: tensors[k] for k in expected}, strict=True, assign=True)


def _few(names: list[str]) -> str:
    shown = ", ".join(names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")
