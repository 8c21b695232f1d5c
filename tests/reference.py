"""The official `qwen-tts` 0.1.1 package as a test oracle: tiny random checkpoints and greedy generation.

Parity tests build a tiny checkpoint in the official layout with the reference's own classes, load it with the
reference loader, and compare our engine's codes and waveforms with what the reference produces for the same
request. Random weights are re-scaled first: at the stock init (std 0.02, LayerScale 0.01, ConvNeXt gamma 1e-6,
zero codebooks) the text barely reaches the talker, the speaker embedding is ~0 and the decoder outputs silence, so
a comparison would pass for broken code.
"""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

# torchaudio has no wheel that loads under torch 2.13, and only the unreleased 25 Hz tokenizer uses it
# (torchaudio.compliance.kaldi). transformers must be imported first so its own torchaudio probe sees none.
import transformers  # noqa: F401
import transformers.utils.import_utils  # noqa: F401
from torch import nn

if "torchaudio" not in sys.modules:
    _torchaudio = types.ModuleType("torchaudio")
    _compliance = types.ModuleType("torchaudio.compliance")
    _kaldi = types.ModuleType("torchaudio.compliance.kaldi")
    _compliance.kaldi = _kaldi
    _torchaudio.compliance = _compliance
    sys.modules.update({"torchaudio": _torchaudio, "torchaudio.compliance": _compliance,
                        "torchaudio.compliance.kaldi": _kaldi})

import qwen_tts  # noqa: E402
from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig  # noqa: E402
from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSForConditionalGeneration, Qwen3TTSRMSNorm, mel_spectrogram  # noqa: E402
from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config  # noqa: E402
from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (  # noqa: E402
    EuclideanCodebook,
    Qwen3TTSTokenizerV2ConvNeXtBlock,
    Qwen3TTSTokenizerV2DecoderLayerScale,
    Qwen3TTSTokenizerV2DecoderRMSNorm,
    Qwen3TTSTokenizerV2Model,
    SnakeBeta,
)
from transformers.models.mimi.modeling_mimi import MimiEuclideanCodebook, MimiLayerScale  # noqa: E402

from engine.config import RANDOM_WEIGHTS_KEY  # noqa: E402
from engine.synthetic.configs import GENERATION_CONFIG, SPEECH_PREPROCESSOR, model_config, speech_tokenizer_config  # noqa: E402
from engine.synthetic.tokenizer_files import write_tokenizer_files  # noqa: E402

MODES = ("custom_voice", "voice_design", "clone_xvector", "clone_icl")
SPEAKER_ENCODER_KEYS = ("mel_dim", "enc_dim", "enc_channels", "enc_kernel_sizes", "enc_dilations",
                        "enc_attention_channels", "enc_res2net_scale", "enc_se_channels", "sample_rate")
TARGET_WAV_STD = 0.25  # decoder output scale before the reference's clamp to [-1, 1]


def calibration_signal(seconds: float = 2.0, sr: int = 24000, seed: int = 1234) -> np.ndarray:
    """A deterministic speech-like test signal (a few sines + a little noise, peak ~0.5)."""
    t = np.arange(int(seconds * sr)) / sr
    wav = (0.5 * np.sin(2 * np.pi * 220.0 * t) + 0.3 * np.sin(2 * np.pi * 523.25 * t + 0.5)
           + 0.2 * np.sin(2 * np.pi * 1250.0 * t + 1.0) * (0.5 + 0.5 * np.sin(2 * np.pi * 3.0 * t)))
    wav += 0.05 * np.random.default_rng(seed).standard_normal(t.shape)
    return (0.5 * wav / np.abs(wav).max()).astype(np.float32)


def _tiny_speech_tokenizer_config() -> dict[str, Any]:
    """speech_tokenizer_config("tiny") plus the Mimi fields a tiny encoder needs to construct.

    MimiConfig defaults `upsample_groups=512` and `vector_quantization_hidden_dimension=256` fit only the real widths.
    """
    config = speech_tokenizer_config("tiny")
    encoder = config["encoder_config"]
    encoder.setdefault("upsample_groups", encoder["hidden_size"])
    encoder.setdefault("vector_quantization_hidden_dimension", encoder["codebook_dim"])
    return config


@torch.no_grad()
def _randomize(module: nn.Module) -> None:
    """Scale-preserving random weights (unit-variance activations), random norms and biases."""
    for sub in module.modules():
        if isinstance(sub, nn.Embedding):
            sub.weight.normal_(0.0, 1.0)
        elif isinstance(sub, nn.Linear):
            sub.weight.normal_(0.0, sub.in_features ** -0.5)
            if sub.bias is not None:
                sub.bias.normal_(0.0, 0.1)
        elif isinstance(sub, nn.ConvTranspose1d):
            fan_in = sub.in_channels // sub.groups * sub.kernel_size[0] / sub.stride[0]
            sub.weight.normal_(0.0, fan_in ** -0.5)
            if sub.bias is not None:
                sub.bias.normal_(0.0, 0.1)
        elif isinstance(sub, nn.Conv1d):
            sub.weight.normal_(0.0, (sub.in_channels // sub.groups * sub.kernel_size[0]) ** -0.5)
            if sub.bias is not None:
                sub.bias.normal_(0.0, 0.1)
        elif isinstance(sub, (Qwen3TTSRMSNorm, Qwen3TTSTokenizerV2DecoderRMSNorm)):
            sub.weight.uniform_(0.5, 1.5)
        elif isinstance(sub, nn.LayerNorm):
            if sub.weight is not None:
                sub.weight.uniform_(0.5, 1.5)
            if sub.bias is not None:
                sub.bias.normal_(0.0, 0.1)
        elif isinstance(sub, (Qwen3TTSTokenizerV2DecoderLayerScale, MimiLayerScale)):
            sub.scale.uniform_(0.5, 1.5)
        elif isinstance(sub, Qwen3TTSTokenizerV2ConvNeXtBlock):
            sub.gamma.uniform_(0.5, 1.5)
        elif isinstance(sub, SnakeBeta):
            sub.alpha.normal_(0.0, 0.3)
            sub.beta.normal_(0.0, 0.3)
        elif isinstance(sub, EuclideanCodebook):
            sub.cluster_usage.uniform_(0.5, 1.5)
            sub.embedding_sum.normal_(0.0, 1.0)


@torch.no_grad()
def _calibrate_encoder_codebooks(tokenizer: Qwen3TTSTokenizerV2Model, wav: np.ndarray) -> None:
    """Give each Mimi codebook centroids at the scale of the latents it quantizes, so encoded codes vary.

    With centroids much larger (or smaller) than the latents, argmin picks the same centroid for every frame.
    """
    quantizer = tokenizer.encoder.quantizer
    rvqs = {"semantic": quantizer.semantic_residual_vector_quantizer,
            "acoustic": quantizer.acoustic_residual_vector_quantizer}
    seen: dict[str, float] = {}

    def recording(name: str, encode: Any) -> Any:
        def wrapped(latents: torch.Tensor) -> torch.Tensor:
            seen[name] = float(latents.std())
            return encode(latents)
        return wrapped

    for name, rvq in rvqs.items():  # record what the first codebook of each RVQ is asked to quantize
        rvq.layers[0].codebook.encode = recording(name, rvq.layers[0].codebook.encode)
    try:
        tokenizer.encoder.encode(torch.from_numpy(wav)[None, None], return_dict=True)
    finally:
        for rvq in rvqs.values():
            del rvq.layers[0].codebook.encode
    for name, rvq in rvqs.items():
        for layer in rvq.layers:
            codebook: MimiEuclideanCodebook = layer.codebook
            codebook.cluster_usage.uniform_(0.5, 1.5)
            codebook.embed_sum.copy_(torch.randn_like(codebook.embed_sum) * seen[name]
                                     * codebook.cluster_usage[:, None])
            codebook._embed = None


@torch.no_grad()
def _calibrate_decoder_output(tokenizer: Qwen3TTSTokenizerV2Model) -> None:
    """Scale the decoder's last conv so random codes decode to std ~TARGET_WAV_STD (audible, rarely clipped)."""
    last = tokenizer.decoder.decoder[-1].conv
    seen: list[torch.Tensor] = []
    hook = last.register_forward_hook(lambda m, i, o: seen.append(o))
    try:
        codes = torch.randint(0, tokenizer.config.decoder_config.codebook_size, (1, 16, 24))
        tokenizer.decoder(codes)
    finally:
        hook.remove()
    gain = TARGET_WAV_STD / float(seen[0].std())
    last.weight.mul_(gain)
    last.bias.mul_(gain)


@torch.no_grad()
def _calibrate_speaker_encoder(model: Qwen3TTSForConditionalGeneration, wav: np.ndarray) -> None:
    """Scale the speaker encoder's last layer so the x-vector has unit std, like the codec embeddings it sits among."""
    mels = mel_spectrogram(torch.from_numpy(wav)[None], n_fft=1024, num_mels=128, sampling_rate=24000,
                           hop_size=256, win_size=1024, fmin=0, fmax=12000).transpose(1, 2)
    embedding = model.speaker_encoder(mels)
    gain = 1.0 / float(embedding.std())
    model.speaker_encoder.fc.weight.mul_(gain)
    model.speaker_encoder.fc.bias.mul_(gain)


def build_reference_checkpoint(out_dir: Path, variant: str, seed: int = 0) -> Path:
    """Write a tiny random fp32 checkpoint of `variant` in the official layout, using the reference's classes.

    Deterministic for a given seed. Returns `out_dir`.
    """
    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    model = Qwen3TTSForConditionalGeneration(Qwen3TTSConfig(**model_config("tiny", variant))).float().eval()
    tokenizer = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**_tiny_speech_tokenizer_config())).float().eval()
    _randomize(model)
    _randomize(tokenizer)
    wav = calibration_signal()
    _calibrate_encoder_codebooks(tokenizer, wav)
    _calibrate_decoder_output(tokenizer)
    if model.speaker_encoder is not None:
        _calibrate_speaker_encoder(model, wav)

    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir / "speech_tokenizer")
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    if "speaker_encoder_config" in config:  # the reference's loader rejects everything but the constructor args
        config["speaker_encoder_config"] = {k: v for k, v in config["speaker_encoder_config"].items()
                                            if k in SPEAKER_ENCODER_KEYS}
    config[RANDOM_WEIGHTS_KEY] = True  # random weights, marked as ours are: the reference loads it as an extra key
    config_path.write_text(json.dumps(config, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    (out_dir / "speech_tokenizer" / "preprocessor_config.json").write_text(json.dumps(SPEECH_PREPROCESSOR, indent=2))
    write_tokenizer_files(out_dir)
    return out_dir


def load_reference(model_dir: Path) -> qwen_tts.Qwen3TTSModel:
    """Load a checkpoint with the reference wrapper, fp32 on the CPU."""
    return qwen_tts.Qwen3TTSModel.from_pretrained(str(model_dir), dtype=torch.float32, device_map="cpu",
                                                  attn_implementation="sdpa")


def reference_generate(tts: qwen_tts.Qwen3TTSModel, mode: str, text: str, *, speaker: str | None = None,
                       instruct: str | None = None, ref_audio: tuple[np.ndarray, int] | None = None,
                       ref_text: str | None = None, language: str = "english", non_streaming_mode: bool,
                       frames: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Greedy reference generation through the public wrapper: (codes [T,16] int64, wav float32, ref_codes or None).

    The wrapper's own method runs (so prompt building and decoding are the reference's); the codes and the ICL
    reference codes are captured from its call to `model.generate`. `max_new_tokens=frames + 1` because the reference
    returns at most max_new_tokens - 1 frames; fewer come back if EOS is drawn.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: {MODES}")
    captured: dict[str, Any] = {}
    original = tts.model.generate

    def recording_generate(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        captured["codes"] = result[0][0]
        prompt = kwargs.get("voice_clone_prompt")
        captured["ref_code"] = prompt["ref_code"][0] if prompt and prompt.get("ref_code") is not None else None
        return result

    gen = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=frames + 1,
               non_streaming_mode=non_streaming_mode)
    tts.model.generate = recording_generate
    try:
        if mode == "custom_voice":
            wavs, _ = tts.generate_custom_voice(text=text, speaker=speaker, language=language, instruct=instruct,
                                                **gen)
        elif mode == "voice_design":
            wavs, _ = tts.generate_voice_design(text=text, instruct=instruct, language=language, **gen)
        else:
            if ref_audio is None:
                raise ValueError(f"{mode} needs ref_audio=(array, sample_rate)")
            wavs, _ = tts.generate_voice_clone(text=text, language=language, ref_audio=ref_audio, ref_text=ref_text,
                                               x_vector_only_mode=mode == "clone_xvector", **gen)
    finally:
        del tts.model.generate  # drop the instance attribute; the class method shows through again
    codes = captured["codes"].detach().cpu().numpy().astype(np.int64)
    ref_code = captured["ref_code"]
    ref_codes = None if ref_code is None else ref_code.detach().cpu().numpy().astype(np.int64)
    return codes, np.asarray(wavs[0], dtype=np.float32), ref_codes
