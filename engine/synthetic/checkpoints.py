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

from engine.config import RANDOM_WEIGHTS_KEY, SpeechTokenizerConfig, parse_model_config, parse_speech_tokenizer_config
from engine.model.codec_decoder import CodecDecoder
from engine.model.reference_encoder import ReferenceEncoder
from engine.model.speaker_encoder import SpeakerEncoder
from engine.model.talker import Talker
from engine.synthetic.configs import GENERATION_CONFIG, SPEECH_PREPROCESSOR, model_config, speech_tokenizer_config
from engine.synthetic.tokenizer_files import write_tokenizer_files

DEFAULT_VARIANT = "custom_voice"
DEFAULT_MODEL_VERSION = 2  # bump when the tiny default model's recipe changes, so caches are rebuilt (2: the mark)


def _prefixed(prefix: str, module: nn.Module) -> dict[str, torch.Tensor]:
    return {prefix + name: tensor for name, tensor in module.state_dict().items()}


def _decoder_tensors(speech: SpeechTokenizerConfig) -> dict[str, torch.Tensor]:
    """The decoder's tensors plus the encode-side projections the official file carries (decoding never reads
    them)."""
    tensors = _prefixed("decoder.", CodecDecoder(speech.decoder))
    dim = speech.decoder.codebook_dim
    for group in ("rvq_first", "rvq_rest"):
        tensors[f"decoder.quantizer.{group}.input_proj.weight"] = torch.empty(dim // 2, dim, 1)
    return tensors


def _encoder_tensors(speech: SpeechTokenizerConfig) -> dict[str, torch.Tensor]:
    """Mimi's encoder half as the official file stores it: what our reference encoder reads, plus the codebooks
    past the valid count, the output projections and the codebooks' `initialized` flags."""
    encoder = ReferenceEncoder(speech)
    tensors = _prefixed("encoder.", encoder)
    spec = encoder.spec
    groups = {"semantic": spec.num_semantic_quantizers, "acoustic": spec.num_quantizers - spec.num_semantic_quantizers}
    for kind, books in groups.items():
        base = f"encoder.quantizer.{kind}_residual_vector_quantizer"
        first = f"{base}.layers.0.codebook."
        for book in range(books):
            layer = f"{base}.layers.{book}.codebook."
            tensors.setdefault(layer + "cluster_usage", torch.empty_like(tensors[first + "cluster_usage"]))
            tensors.setdefault(layer + "embed_sum", torch.empty_like(tensors[first + "embed_sum"]))
            tensors[layer + "initialized"] = torch.empty(1)
        projection = tensors.get(f"{base}.input_proj.weight")
        if projection is not None:
            tensors[f"{base}.output_proj.weight"] = torch.empty(projection.shape[1], projection.shape[0], 1)
    return tensors


def build_tensors(size: str, variant: str) -> dict[str, dict[str, torch.Tensor]]:
    """file -> tensor name -> an uninitialised tensor on the meta device."""
    config = parse_model_config(model_config(size, variant))
    speech = parse_speech_tokenizer_config(speech_tokenizer_config(size))
    with torch.device("meta"):
        main = _prefixed("talker.", Talker(config.talker))
        if config.speaker_encoder is not None:
            main |= _prefixed("speaker_encoder.", SpeakerEncoder(config.speaker_encoder))
        codec = _decoder_tensors(speech) | _encoder_tensors(speech)
    return {"model.safetensors": main, "speech_tokenizer/model.safetensors": codec}


def tensor_shapes(size: str, variant: str) -> dict[str, dict[str, tuple[int, ...]]]:
    """file -> tensor name -> shape, without allocating anything (CI checks real sizes this way)."""
    return {file: {name: tuple(t.shape) for name, t in tensors.items()}
            for file, tensors in build_tensors(size, variant).items()}


def _randomize(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
    """Values that keep a random model numerically lively: unit norms, fan-in scaled weights, and O(1) layer
    scales and Snake parameters so the random decoder is not near-silent."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("cluster_usage", "initialized") or name.endswith("norm.weight") or "layernorm" in name:
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
    """Writes the whole official layout; real sizes are stored in bf16, tiny ones in fp32. config.json is marked as
    random weights (RANDOM_WEIGHTS_KEY), so that benchmark-only settings know it has no speech to cut."""
    dtype = dtype or (torch.float32 if size == "tiny" else torch.bfloat16)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "speech_tokenizer").mkdir(exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    for file, metas in build_tensors(size, variant).items():
        tensors = {}
        for name, meta in metas.items():
            value = torch.empty(meta.shape, dtype=torch.float32)
            _randomize(name, value, generator)
            tensors[name] = value.to(dtype)
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        del tensors
    _write_json(out_dir / "config.json", model_config(size, variant) | {RANDOM_WEIGHTS_KEY: True})
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
