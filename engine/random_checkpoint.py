"""Random checkpoints in the exact official layout: tiny ones for tests and the embedded default model, and real
0.6B / 1.7B sizes for GPU benchmarks (no weights can be downloaded here; speed does not depend on the values).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from engine.config import parse_model_config, parse_speech_tokenizer_config
from engine.model.codec_decoder import CodecDecoder
from engine.model.speaker_encoder import SpeakerEncoder
from engine.model.talker import Talker
from engine.model_configs import GENERATION_CONFIG, SPEECH_PREPROCESSOR, model_config, speech_tokenizer_config
from engine.tokenizer_files import write_tokenizer_files

DEFAULT_VARIANT = "custom_voice"
DEFAULT_MODEL_VERSION = 1  # bump when the tiny default model's recipe changes, so caches are rebuilt


def build_modules(size: str, variant: str) -> dict[str, dict[str, nn.Module]]:
    """Uninitialised modules on the meta device, grouped by file and tensor-name prefix."""
    config = parse_model_config(model_config(size, variant))
    speech = speech_tokenizer_config(size)
    with torch.device("meta"):
        main: dict[str, nn.Module] = {"talker.": Talker(config.talker)}
        if config.speaker_encoder is not None:
            main["speaker_encoder."] = SpeakerEncoder(config.speaker_encoder)
        codec = {"decoder.": CodecDecoder(parse_speech_tokenizer_config(speech).decoder),
                 "decoder.quantizer.": _QuantizerInputProjections(speech["decoder_config"]),
                 "encoder.": _mimi_encoder(speech["encoder_config"])}
    return {"model.safetensors": main, "speech_tokenizer/model.safetensors": codec}


class _QuantizerInputProjections(nn.Module):
    """The encode-side projections the official decoder file carries (decoding never reads them)."""

    def __init__(self, decoder_config: dict) -> None:
        super().__init__()
        dim = decoder_config["codebook_dim"]
        self.rvq_first = nn.ModuleDict({"input_proj": nn.Conv1d(dim, dim // 2, 1, bias=False)})
        self.rvq_rest = nn.ModuleDict({"input_proj": nn.Conv1d(dim, dim // 2, 1, bias=False)})


def _mimi_encoder(encoder_config: dict) -> nn.Module:
    """transformers' Mimi without its decoder half, as the official speech tokenizer stores it."""
    from transformers import MimiConfig, MimiModel

    mimi = MimiModel(MimiConfig(**encoder_config))
    for name in ("upsample", "decoder_transformer", "decoder"):
        delattr(mimi, name)
    return mimi


def tensor_shapes(size: str, variant: str) -> dict[str, dict[str, tuple[int, ...]]]:
    """file -> tensor name -> shape, without allocating anything (CI checks real sizes this way)."""
    return {file: {prefix + name: tuple(t.shape) for prefix, module in modules.items()
                   for name, t in module.state_dict().items()}
            for file, modules in build_modules(size, variant).items()}


def _randomize(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
    """Values that keep a random model numerically lively: unit norms, fan-in scaled weights, and O(1) layer
    scales and Snake parameters so the random decoder is not near-silent."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("cluster_usage",) or name.endswith("norm.weight") or "layernorm" in name:
        tensor.fill_(1.0)
    elif leaf in ("scale", "gamma"):
        tensor.uniform_(0.5, 1.0, generator=generator)
    elif leaf in ("alpha", "beta"):
        tensor.normal_(0.0, 0.1, generator=generator)
    elif leaf == "bias" or tensor.dim() == 1:
        tensor.normal_(0.0, 0.02, generator=generator)
    elif "embedding" in name:
        tensor.normal_(0.0, 1.0, generator=generator)
    else:
        # Residual branches of the decoder's conv stack start small, so the signal does not double per block
        # and the output stays mostly inside [-1, 1].
        gain = 0.2 if name.endswith("conv2.conv.weight") else 1.0
        tensor.normal_(0.0, gain / math.sqrt(tensor[0].numel()), generator=generator)


def write_random_checkpoint(out_dir: Path, size: str, variant: str, seed: int = 0,
                            dtype: torch.dtype | None = None) -> Path:
    """Writes the whole official layout; real sizes are stored in bf16, tiny ones in fp32."""
    dtype = dtype or (torch.float32 if size == "tiny" else torch.bfloat16)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "speech_tokenizer").mkdir(exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    for file, modules in build_modules(size, variant).items():
        tensors = {}
        for prefix, module in modules.items():
            for name, meta in module.state_dict().items():
                value = torch.empty(meta.shape, dtype=torch.float32)
                _randomize(prefix + name, value, generator)
                tensors[prefix + name] = value.to(dtype)
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        del tensors
    _write_json(out_dir / "config.json", model_config(size, variant))
    _write_json(out_dir / "generation_config.json", GENERATION_CONFIG)
    _write_json(out_dir / "speech_tokenizer" / "config.json", speech_tokenizer_config(size))
    _write_json(out_dir / "speech_tokenizer" / "preprocessor_config.json", SPEECH_PREPROCESSOR)
    write_tokenizer_files(out_dir)
    return out_dir


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "voxgate"


def default_model_dir() -> Path:
    """The embedded default model: a tiny random CustomVoice checkpoint with the real 1.7B speaker map,
    built on first use and cached (never committed as a binary)."""
    target = cache_root() / "models" / f"tiny-{DEFAULT_VARIANT}-v{DEFAULT_MODEL_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        write_random_checkpoint(staging, "tiny", DEFAULT_VARIANT, seed=0)
        os.replace(staging, target)
    except OSError:
        if not (target / "config.json").is_file():  # another process may have won the race
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
