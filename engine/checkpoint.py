"""Load the official checkpoint layout into our modules, naming any missing or malformed file or tensor."""
from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from engine.errors import CheckpointError

# Tensors the checkpoint carries that decoding never reads: the quantizer's encode-side projections.
UNUSED_DECODER_TENSORS = frozenset({"quantizer.rvq_first.input_proj.weight", "quantizer.rvq_rest.input_proj.weight"})
# what identifies a checkpoint: its configs whole, and its weight files sampled (safetensors_sample)
FINGERPRINT_CONFIGS = ("config.json", "speech_tokenizer/config.json")
FINGERPRINT_WEIGHTS = ("model.safetensors", "speech_tokenizer/model.safetensors")
FINGERPRINT_SAMPLE_BYTES = 4096  # from each end of each tensor


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


def checkpoint_fingerprint(model_dir: Path) -> str:
    """A hex digest that tells checkpoints apart: their configs, every tensor's name, dtype and shape, and the first
    and last bytes of every tensor. Another size, variant, seed or fine-tune changes it, yet it reads a few MB even of
    the 1.7B model (hashing its 4.5 GB whole would add seconds to every start). Tensors precomputed for one checkpoint
    (a stored voice's speaker embedding and reference codes) are keyed by it."""
    digest = hashlib.sha256()
    for name in FINGERPRINT_CONFIGS:
        digest.update(name.encode() + b"\0" + _read(model_dir / name))
    for name in FINGERPRINT_WEIGHTS:
        digest.update(name.encode() + b"\0" + safetensors_sample(model_dir / name))
    return digest.hexdigest()


def safetensors_sample(path: Path) -> bytes:
    """The file's header (every tensor's name, dtype, shape and offsets) and up to FINGERPRINT_SAMPLE_BYTES from
    each end of each tensor's data."""
    try:
        with open(path, "rb") as file:
            (header_size,) = struct.unpack("<Q", file.read(8))
            header = file.read(header_size)
            sample = [header]
            for name, entry in sorted(json.loads(header).items()):
                if name == "__metadata__":
                    continue
                start, end = (8 + header_size + offset for offset in entry["data_offsets"])
                for at in sorted({start, max(start, end - FINGERPRINT_SAMPLE_BYTES)}):
                    file.seek(at)
                    sample.append(file.read(min(FINGERPRINT_SAMPLE_BYTES, end - at)))
            return b"".join(sample)
    except (OSError, struct.error, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"malformed checkpoint file {path}: {exc}") from exc


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"missing checkpoint file: {path}") from exc
