"""Checkpoint configs as typed dataclasses.

Every size comes from the checkpoint's `config.json` files, never from constants, so that the 0.6B, the 1.7B and
the tiny test checkpoints all load through the same code.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError


@dataclass(frozen=True)
class TransformerConfig:
    """A stack of Qwen3 transformer blocks (the talker and the code predictor share this shape)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    attention_bias: bool = False


@dataclass(frozen=True)
class CodePredictorConfig:
    layers: TransformerConfig
    vocab_size: int
    num_code_groups: int


@dataclass(frozen=True)
class TalkerConfig:
    layers: TransformerConfig
    vocab_size: int
    text_vocab_size: int
    text_hidden_size: int
    num_code_groups: int
    codec_bos_id: int
    codec_eos_token_id: int
    codec_pad_id: int
    codec_think_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    spk_id: dict[str, int]
    spk_is_dialect: dict[str, str | bool]
    codec_language_id: dict[str, int]
    code_predictor: CodePredictorConfig


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    enc_dim: int
    mel_dim: int = 128
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000


@dataclass(frozen=True)
class CodecDecoderConfig:
    codebook_size: int
    codebook_dim: int
    latent_dim: int
    decoder_dim: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    sliding_window: int
    rope_theta: float
    rms_norm_eps: float
    layer_scale_initial_scale: float
    num_quantizers: int
    upsample_rates: tuple[int, ...]
    upsampling_ratios: tuple[int, ...]
    attention_bias: bool = False

    @property
    def samples_per_frame(self) -> int:
        total = 1
        for r in (*self.upsample_rates, *self.upsampling_ratios):
            total *= r
        return total


@dataclass(frozen=True)
class SpeechTokenizerConfig:
    decoder: CodecDecoderConfig
    encoder: dict[str, Any]  # a transformers MimiConfig, passed through as is
    encoder_valid_num_quantizers: int
    output_sample_rate: int
    input_sample_rate: int


@dataclass(frozen=True)
class GenerationDefaults:
    """generation_config.json: the reference's sampling defaults."""

    do_sample: bool = True
    top_k: int = 50
    top_p: float = 1.0
    temperature: float = 0.9
    repetition_penalty: float = 1.05
    subtalker_dosample: bool = True
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    subtalker_temperature: float = 0.9
    max_new_tokens: int = 8192


MODEL_TYPES = ("base", "custom_voice", "voice_design")
# config.json's mark of a random-weight checkpoint (`voxgate make-checkpoint`): benchmark-only settings that would cut
# a real model's speech (EngineConfig.synthetic_frames_per_token) are refused without it.
RANDOM_WEIGHTS_KEY = "voxgate_random_weights"


@dataclass(frozen=True)
class ModelConfig:
    talker: TalkerConfig
    speaker_encoder: SpeakerEncoderConfig | None
    tts_model_type: str
    tts_model_size: str
    tts_pad_token_id: int
    tts_bos_token_id: int
    tts_eos_token_id: int
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    random_weights: bool = False  # config.json has RANDOM_WEIGHTS_KEY: true (written by engine/synthetic only)

    @property
    def languages(self) -> list[str]:
        """Languages a user may ask for: `auto` and the non-dialect language ids, as the reference lists them."""
        return ["auto"] + sorted(k for k in self.talker.codec_language_id if "dialect" not in k)

    @property
    def speakers(self) -> list[str]:
        return sorted(self.talker.spk_id)


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"missing checkpoint file: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"malformed checkpoint file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"malformed checkpoint file {path}: expected a JSON object")
    return data


def _require(data: dict[str, Any], key: str, where: str) -> Any:
    if key not in data:
        raise CheckpointError(f"{where}: missing field {key!r}")
    return data[key]


def _layers(data: dict[str, Any], where: str) -> TransformerConfig:
    hidden = _require(data, "hidden_size", where)
    heads = _require(data, "num_attention_heads", where)
    return TransformerConfig(
        hidden_size=hidden,
        intermediate_size=_require(data, "intermediate_size", where),
        num_hidden_layers=_require(data, "num_hidden_layers", where),
        num_attention_heads=heads,
        num_key_value_heads=data.get("num_key_value_heads") or heads,
        head_dim=data.get("head_dim") or hidden // heads,
        rope_theta=float(data.get("rope_theta", 10000.0)),
        rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        attention_bias=bool(data.get("attention_bias", False)),
    )


def _speaker_map(raw: dict[str, Any]) -> dict[str, int]:
    """Speaker ids are ints in some configs and one-element lists in others."""
    return {name.lower(): int(v[0] if isinstance(v, list) else v) for name, v in raw.items()}


def parse_talker(data: dict[str, Any]) -> TalkerConfig:
    where = "config.json talker_config"
    cp = _require(data, "code_predictor_config", where)
    cp_where = where + ".code_predictor_config"
    return TalkerConfig(
        layers=_layers(data, where),
        vocab_size=_require(data, "vocab_size", where),
        text_vocab_size=_require(data, "text_vocab_size", where),
        text_hidden_size=_require(data, "text_hidden_size", where),
        num_code_groups=_require(data, "num_code_groups", where),
        codec_bos_id=_require(data, "codec_bos_id", where),
        codec_eos_token_id=_require(data, "codec_eos_token_id", where),
        codec_pad_id=_require(data, "codec_pad_id", where),
        codec_think_id=_require(data, "codec_think_id", where),
        codec_nothink_id=_require(data, "codec_nothink_id", where),
        codec_think_bos_id=_require(data, "codec_think_bos_id", where),
        codec_think_eos_id=_require(data, "codec_think_eos_id", where),
        spk_id=_speaker_map(data.get("spk_id") or {}),
        spk_is_dialect={k.lower(): v for k, v in (data.get("spk_is_dialect") or {}).items()},
        codec_language_id={k.lower(): int(v) for k, v in (data.get("codec_language_id") or {}).items()},
        code_predictor=CodePredictorConfig(
            layers=_layers(cp, cp_where),
            vocab_size=_require(cp, "vocab_size", cp_where),
            num_code_groups=_require(cp, "num_code_groups", cp_where),
        ),
    )


def _dataclass_kwargs(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items() if k in names}


def parse_model_config(data: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    model_type = _require(data, "tts_model_type", "config.json")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"config.json: unknown tts_model_type {model_type!r} (expected one of {MODEL_TYPES})")
    talker = parse_talker(_require(data, "talker_config", "config.json"))
    speaker_encoder = None
    if model_type == "base":
        raw = dict(data.get("speaker_encoder_config") or {})
        raw.setdefault("enc_dim", talker.layers.hidden_size)
        speaker_encoder = SpeakerEncoderConfig(**_dataclass_kwargs(SpeakerEncoderConfig, raw))
    return ModelConfig(
        talker=talker,
        speaker_encoder=speaker_encoder,
        tts_model_type=model_type,
        tts_model_size=str(data.get("tts_model_size") or ""),
        tts_pad_token_id=int(data.get("tts_pad_token_id", 151671)),
        tts_bos_token_id=int(data.get("tts_bos_token_id", 151672)),
        tts_eos_token_id=int(data.get("tts_eos_token_id", 151673)),
        generation=GenerationDefaults(**_dataclass_kwargs(GenerationDefaults, generation or {})),
        random_weights=data.get(RANDOM_WEIGHTS_KEY) is True,
    )


def parse_speech_tokenizer_config(data: dict[str, Any]) -> SpeechTokenizerConfig:
    where = "speech_tokenizer/config.json decoder_config"
    dec = dict(_require(data, "decoder_config", "speech_tokenizer/config.json"))
    heads = _require(dec, "num_attention_heads", where)
    hidden = _require(dec, "hidden_size", where)
    dec.setdefault("head_dim", hidden // heads)
    dec.setdefault("num_key_value_heads", heads)
    required = [f.name for f in fields(CodecDecoderConfig) if f.name != "attention_bias"]
    for name in required:
        _require(dec, name, where)
    return SpeechTokenizerConfig(
        decoder=CodecDecoderConfig(**_dataclass_kwargs(CodecDecoderConfig, dec)),
        encoder=dict(data.get("encoder_config") or {}),
        encoder_valid_num_quantizers=int(data.get("encoder_valid_num_quantizers", 16)),
        output_sample_rate=int(data.get("output_sample_rate", 24000)),
        input_sample_rate=int(data.get("input_sample_rate", 24000)),
    )


def _parse_file(path: Path, parse: Callable[[dict[str, Any]], Any]) -> Any:
    """Parse one config file; a field of the wrong type becomes an error naming the file, not a traceback."""
    data = read_json(path)
    try:
        return parse(data)
    except (TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"malformed checkpoint file {path}: {exc}") from exc


def load_model_config(model_dir: Path) -> ModelConfig:
    generation = read_json(model_dir / "generation_config.json")
    return _parse_file(model_dir / "config.json", lambda data: parse_model_config(data, generation))


def load_speech_tokenizer_config(model_dir: Path) -> SpeechTokenizerConfig:
    return _parse_file(model_dir / "speech_tokenizer" / "config.json", parse_speech_tokenizer_config)
