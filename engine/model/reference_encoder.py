"""Reference audio -> speech codes, for voice-clone (Base, in-context) prompts only; never on the streaming hot path.

The speech tokenizer's encoder is the encoder half of a Mimi codec: a causal SEANet conv stack (24 kHz -> 25 Hz),
a causal transformer, a stride-2 conv (-> 12.5 Hz) and a split residual vector quantizer (1 semantic + N acoustic
codebooks). It is re-implemented here rather than wrapped from `transformers.MimiModel`, whose module layout (and so
its state-dict names) changed within transformers 5.x. Module names mirror the checkpoint's `encoder.*` tensors.

What the reference (qwen-tts 0.1.1 on transformers 4.57.3) does, and this module reproduces bit for bit:
  * resampling with `librosa.resample` defaults: soxr "HQ", then zero-padded or trimmed to ceil(n * ratio) samples;
  * its EncodecFeatureExtractor, which is the identity for one mono clip (no padding, all-ones mask);
  * full causal self-attention in the encoder transformer: transformers 4.57's Mimi ignores `sliding_window` (250),
    which only matters for clips over 10 s;
  * the first `encoder_valid_num_quantizers` codebooks and ceil(samples / samples_per_frame) frames.
"""
from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
import soxr
import torch
import torch.nn.functional as F
from torch import nn

from engine.checkpoint import load_module, read_tensors
from engine.config import SpeechTokenizerConfig, parse_speech_tokenizer_config, read_json
from engine.errors import (
    AudioInputError,
    CheckpointError,
    ReferenceTooLong,
    ReferenceTooShort,
    UndecodableAudio,
    UnreadableAudio,
)
from engine.model.layers import LayerScale, RotaryEmbedding, apply_rope, repeat_kv

MIN_REFERENCE_SECONDS = 0.5
MIN_REFERENCE_RATE = 8000  # telephone speech; below it there is no voice to clone (a 2-sample, 1 Hz WAV was taken)
MAX_REFERENCE_PEAK = 2.0  # float audio a little past full scale is taken as it is; 1e6 is not audio
# A file is decoded whole, all its channels: a 165 KB FLAC of 8 channels at 655 kHz decoded to 600 MB (a hostile
# upload; an Ogg Vorbis file may have 255 channels). With at most the highest studio rate and 8 channels (7.1), a
# 30 s upload decodes to at most 184 MB. (Decoding block by block is not the same: libsndfile's MP3 reads differ.)
MAX_REFERENCE_RATE = 192_000
MAX_REFERENCE_CHANNELS = 8
UNKNOWN_FRAMES = 2**63 - 1  # libsndfile's frame count of a file whose header does not record its length
LIBSNDFILE_NOT_A_FILE = 7  # its error "File does not exist or is not a regular file (possibly a pipe?)"
CHECKPOINT_PREFIX = "encoder."


# ---------------------------------------------------------------------------------------------------------------------
# Audio input
# ---------------------------------------------------------------------------------------------------------------------

def load_reference_audio(path: str | Path) -> tuple[np.ndarray, int]:
    """Read a reference audio file as mono float32 (channels averaged) and its sample rate.

    Rule: the file must exist, be readable by libsndfile, and hold at least MIN_REFERENCE_SECONDS of finite samples;
    anything else raises AudioInputError naming the file. Silence is not rejected (it is valid, if useless, audio).
    """
    path = Path(path)
    if not path.is_file():
        raise AudioInputError(f"reference audio not found: {path}")
    return decode_reference_audio(path, f"reference audio {path}")


def decode_reference_audio(source: Path | bytes, name: str, min_seconds: float = MIN_REFERENCE_SECONDS,
                           max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """A file or its bytes (WAV, FLAC, OGG, MP3, ... whatever libsndfile reads) as mono float32 and its rate.

    Raises UnreadableAudio (not decodable, no samples, NaN or infinite samples, a rate or channels past the caps),
    ReferenceTooShort (under `min_seconds`, at least MIN_REFERENCE_SECONDS) and ReferenceTooLong (over `max_seconds`,
    told from the header before decoding, so that a small compressed file cannot expand into minutes of samples; with
    the caps on rate and channels, a bounded decode); `name` starts each message."""
    try:
        with sf.SoundFile(io.BytesIO(source) if isinstance(source, bytes) else str(source)) as file:
            rate = int(file.samplerate)
            if rate > MAX_REFERENCE_RATE:
                raise UnreadableAudio(f"{name} has a sample rate of {rate} Hz; at most {MAX_REFERENCE_RATE} Hz is "
                                      "taken")
            if rate < MIN_REFERENCE_RATE:  # from the header, before its length (1 Hz read as hours: "too long")
                raise UnreadableAudio(f"{name} has a sample rate of {rate} Hz; speech needs at least "
                                      f"{MIN_REFERENCE_RATE} Hz")
            if file.channels > MAX_REFERENCE_CHANNELS:
                raise UnreadableAudio(f"{name} has {file.channels} channels; at most {MAX_REFERENCE_CHANNELS} are "
                                      "taken")
            if file.frames == UNKNOWN_FRAMES:
                audio = _decode_unrecorded_length(source, name, max_seconds, file.channels)
            elif max_seconds is not None and file.frames / rate > max_seconds:
                raise ReferenceTooLong(f"{name} is too long ({math.ceil(file.frames / rate * 1000) / 1000:g} s); "
                                       f"at most {max_seconds:g} s is taken")
            else:
                audio = file.read(dtype="float32", always_2d=True)
    except AudioInputError:
        raise
    except Exception as exc:  # libsndfile raises several types (LibsndfileError, RuntimeError, TypeError)
        # LibsndfileError's own words, without its "Error opening <object at 0x...>: " prefix; not its words about a
        # file that is not there (a path was checked before), which it says when none of its decoders can start
        reason = getattr(exc, "error_string", None) or str(exc)
        if getattr(exc, "code", None) == LIBSNDFILE_NOT_A_FILE:
            reason = "none of the decoders can read it (not audio, or corrupt)"
        raise UndecodableAudio(f"cannot read {name}: {reason}") from exc
    if audio.size == 0:
        raise UnreadableAudio(f"{name} is empty (no samples)")
    mono = audio.mean(axis=1) if audio.shape[1] > 1 else audio[:, 0]
    seconds = mono.size / rate
    if seconds < max(min_seconds, MIN_REFERENCE_SECONDS):
        raise ReferenceTooShort(f"{name} is too short ({math.floor(seconds * 1000) / 1000:g} s); at least "
                                f"{max(min_seconds, MIN_REFERENCE_SECONDS):g} s is needed")  # never shown as the bound
    if not np.isfinite(mono).all():
        raise UnreadableAudio(f"{name} contains NaN or infinite samples")
    peak = float(np.abs(mono).max())
    if peak > MAX_REFERENCE_PEAK:
        raise UnreadableAudio(f"{name} has samples up to {peak:.3g}: audio is within [-1, 1] (at most "
                              f"{MAX_REFERENCE_PEAK:g} is taken)")
    return np.ascontiguousarray(mono, dtype=np.float32), rate


def _decode_unrecorded_length(source: Path | bytes, name: str, max_seconds: float | None, channels: int
                              ) -> np.ndarray:
    """A file whose header does not record its length (a FLAC written to a pipe, as FFmpeg and streaming encoders
    write it): libsndfile reads it as endless, and its reads fail at the end (a seek past the last block), so FFmpeg
    (PyAV) decodes it a frame at a time, to float32 as libsndfile would, and stops once it is past `max_seconds`
    (ReferenceTooLong): a small upload cannot expand into hours. -> [samples, channels]."""
    import av  # the gateway's dependency; only uploads and clone references come here

    with av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source)) as container:
        stream = container.streams.audio[0]
        rate = stream.codec_context.sample_rate
        to_float = av.AudioResampler(format="flt", layout=stream.codec_context.layout, rate=rate)
        blocks, samples = [], 0
        for frame in container.decode(stream):
            for converted in to_float.resample(frame):
                blocks.append(converted.to_ndarray().reshape(-1, channels))
                samples += blocks[-1].shape[0]
            if max_seconds is not None and samples > max_seconds * rate:
                raise ReferenceTooLong(f"{name} is too long (over {max_seconds:g} s); at most {max_seconds:g} s is "
                                       "taken")
    return np.concatenate(blocks) if blocks else np.zeros((0, channels), np.float32)


def to_mono(audio: np.ndarray) -> np.ndarray:
    """[T] stays, [T, channels] (soundfile's layout) is averaged, as the reference does for numpy input."""
    audio = np.asarray(audio, dtype=np.float32)
    if audio.ndim > 1:
        audio = audio.mean(axis=-1)
    return audio


def resample(audio: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """float32 resampling bit-identical to `librosa.resample` defaults, which the reference uses for both the codes
    and the speaker embedding: soxr HQ, then zero-padded or trimmed to ceil(n * ratio) samples."""
    audio = np.asarray(audio, dtype=np.float32)
    if orig_sr == target_sr:
        return audio
    out = soxr.resample(audio, orig_sr, target_sr, quality="HQ")
    # librosa multiplies by the float ratio first: 54243 * (24000 / 44100) rounds up to 29521, not 29520.
    size = math.ceil(audio.shape[0] * (float(target_sr) / orig_sr))
    if out.shape[0] >= size:
        return np.ascontiguousarray(out[:size], dtype=np.float32)
    return np.pad(out, (0, size - out.shape[0])).astype(np.float32)


# ---------------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MimiEncoderSpec:
    """The encoder-side fields of a transformers MimiConfig dict, with MimiConfig's defaults."""

    sampling_rate: int = 24000
    audio_channels: int = 1
    hidden_size: int = 512
    num_filters: int = 64
    num_residual_layers: int = 1
    upsampling_ratios: tuple[int, ...] = (8, 6, 5, 4)
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    use_causal_conv: bool = True
    pad_mode: str = "constant"
    compress: int = 2
    codebook_size: int = 2048
    codebook_dim: int = 256
    num_quantizers: int = 32
    use_conv_shortcut: bool = False
    vector_quantization_hidden_dimension: int = 256
    num_semantic_quantizers: int = 1
    num_hidden_layers: int = 8
    intermediate_size: int = 2048
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int | None = None
    hidden_act: str = "gelu"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention_bias: bool = False
    frame_rate: float | None = None  # saved as "_frame_rate" by transformers

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MimiEncoderSpec:
        names = {f.name for f in fields(cls)}
        raw = {k: v for k, v in data.items() if k in names and v is not None}
        raw.setdefault("frame_rate", data.get("_frame_rate"))
        if "upsampling_ratios" in raw:
            raw["upsampling_ratios"] = tuple(raw["upsampling_ratios"])
        spec = cls(**raw)
        where = "speech_tokenizer/config.json encoder_config"
        if not spec.use_causal_conv:
            raise CheckpointError(f"{where}: only causal convolutions are supported (use_causal_conv=true)")
        if spec.hidden_act != "gelu":
            raise CheckpointError(f"{where}: unsupported hidden_act {spec.hidden_act!r} (expected 'gelu')")
        if data.get("rope_scaling"):
            raise CheckpointError(f"{where}: rope_scaling is not supported")
        if spec.codebook_dim != spec.vector_quantization_hidden_dimension:
            raise CheckpointError(f"{where}: codebook_dim ({spec.codebook_dim}) must equal "
                                  f"vector_quantization_hidden_dimension ({spec.vector_quantization_hidden_dimension})")
        return spec

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def seanet_hop(self) -> int:
        return math.prod(self.upsampling_ratios)

    @property
    def seanet_rate(self) -> int:
        return math.ceil(self.sampling_rate / self.seanet_hop)

    @property
    def code_rate(self) -> float:
        """Frames per second of the codes; Mimi derives it (one stride-2 conv after SEANet) when not given."""
        return self.frame_rate if self.frame_rate is not None else self.sampling_rate / (self.seanet_hop * 2)

    @property
    def has_downsample(self) -> bool:
        return self.code_rate != self.seanet_rate

    @property
    def downsample_kernel(self) -> int:
        return 2 * int(self.seanet_rate / self.code_rate)

    @property
    def samples_per_frame(self) -> int:
        return self.seanet_hop * (2 if self.has_downsample else 1)


# ---------------------------------------------------------------------------------------------------------------------
# SEANet encoder
# ---------------------------------------------------------------------------------------------------------------------

class CausalConv1d(nn.Module):
    """Conv1d that sees only the past: left pad (kernel - stride), right pad to a whole number of strides."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int = 1, dilation: int = 1,
                 bias: bool = True, pad_mode: str = "constant"):
        super().__init__()
        self.conv = nn.Conv1d(in_ch, out_ch, kernel_size, stride, dilation=dilation, bias=bias)
        self.left_pad = (kernel_size - 1) * dilation + 1 - stride
        self.stride = stride
        self.pad_mode = pad_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        right_pad = -length % self.stride
        return self.conv(F.pad(x, (self.left_pad, right_pad), mode=self.pad_mode))


class ResidualUnit(nn.Module):
    """x + conv1x1(elu(conv_k(elu(x)))), the bottleneck halving the channels. Indices 1 and 3 hold the convs."""

    def __init__(self, spec: MimiEncoderSpec, dim: int, dilation: int):
        super().__init__()
        hidden = dim // spec.compress
        self.block = nn.ModuleList([
            nn.ELU(), CausalConv1d(dim, hidden, spec.residual_kernel_size, dilation=dilation, pad_mode=spec.pad_mode),
            nn.ELU(), CausalConv1d(hidden, dim, 1, pad_mode=spec.pad_mode),
        ])
        self.shortcut = CausalConv1d(dim, dim, 1, pad_mode=spec.pad_mode) if spec.use_conv_shortcut else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for layer in self.block:
            y = layer(y)
        return (x if self.shortcut is None else self.shortcut(x)) + y


class SeanetEncoder(nn.Module):
    """Conv stem, then per stride: residual units, ELU, strided conv doubling the channels; then ELU + projection."""

    def __init__(self, spec: MimiEncoderSpec):
        super().__init__()
        pad = spec.pad_mode
        layers: list[nn.Module] = [CausalConv1d(spec.audio_channels, spec.num_filters, spec.kernel_size, pad_mode=pad)]
        channels = spec.num_filters
        for ratio in reversed(spec.upsampling_ratios):
            layers += [ResidualUnit(spec, channels, spec.dilation_growth_rate ** j)
                       for j in range(spec.num_residual_layers)]
            layers += [nn.ELU(), CausalConv1d(channels, channels * 2, ratio * 2, stride=ratio, pad_mode=pad)]
            channels *= 2
        layers += [nn.ELU(), CausalConv1d(channels, spec.hidden_size, spec.last_kernel_size, pad_mode=pad)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# ---------------------------------------------------------------------------------------------------------------------
# Transformer
# ---------------------------------------------------------------------------------------------------------------------

class SelfAttention(nn.Module):
    def __init__(self, spec: MimiEncoderSpec):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (spec.num_attention_heads, spec.num_key_value_heads,
                                                    spec.attention_head_dim)
        self.rotary = RotaryEmbedding(self.head_dim, spec.rope_theta)
        bias = spec.attention_bias
        self.q_proj = nn.Linear(spec.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(spec.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(spec.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, spec.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(torch.arange(length, device=x.device)[None], x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_heads != self.heads:
            k, v = repeat_kv(k, self.heads // self.kv_heads), repeat_kv(v, self.heads // self.kv_heads)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=length > 1)
        return self.o_proj(out.transpose(1, 2).contiguous().view(batch, length, -1))


class FeedForward(nn.Module):
    def __init__(self, spec: MimiEncoderSpec):
        super().__init__()
        self.fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerLayer(nn.Module):
    """Pre-LayerNorm block; both residual branches go through a LayerScale."""

    def __init__(self, spec: MimiEncoderSpec):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.self_attn = SelfAttention(spec)
        self.self_attn_layer_scale = LayerScale(spec.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.mlp = FeedForward(spec)
        self.mlp_layer_scale = LayerScale(spec.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x)))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class EncoderTransformer(nn.Module):
    def __init__(self, spec: MimiEncoderSpec):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(spec) for _ in range(spec.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, C] -> [B, T, C]."""
        for layer in self.layers:
            x = layer(x)
        return x


# ---------------------------------------------------------------------------------------------------------------------
# Quantizer
# ---------------------------------------------------------------------------------------------------------------------

class Codebook(nn.Module):
    """Centroids are stored as EMA statistics (sum and usage); the centroid is their ratio."""

    def __init__(self, size: int, dim: int):
        super().__init__()
        self.register_buffer("embed_sum", torch.zeros(size, dim))
        self.register_buffer("cluster_usage", torch.ones(size))

    def centroids(self) -> torch.Tensor:
        return self.embed_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class VectorQuantizer(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.codebook = Codebook(size, dim)

    def forward(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Nearest centroid of each frame: residual [B, D, T] -> (indices [B, T], quantized [B, D, T])."""
        centroids = self.codebook.centroids()
        frames = residual.permute(0, 2, 1)
        flat = frames.reshape(-1, frames.shape[-1])
        indices = torch.cdist(flat[None].float(), centroids[None].float(), p=2)[0].argmin(dim=-1)
        indices = indices.view(*frames.shape[:-1])
        return indices, F.embedding(indices, centroids).permute(0, 2, 1)


class ResidualQuantizer(nn.Module):
    """Each codebook quantizes what the previous ones left over, after an optional 1x1 projection."""

    def __init__(self, spec: MimiEncoderSpec, num_codebooks: int):
        super().__init__()
        dim = spec.vector_quantization_hidden_dimension
        self.input_proj = None
        if dim != spec.hidden_size:
            self.input_proj = nn.Conv1d(spec.hidden_size, dim, 1, bias=False)
        self.layers = nn.ModuleList(VectorQuantizer(spec.codebook_size, dim) for _ in range(num_codebooks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, T] -> codes [K, B, T]."""
        residual = x if self.input_proj is None else self.input_proj(x)
        codes = []
        for layer in self.layers:
            indices, quantized = layer(residual)
            residual = residual - quantized
            codes.append(indices)
        return torch.stack(codes)


class SplitQuantizer(nn.Module):
    """Semantic codebook(s) and acoustic codebooks quantize the same latents independently."""

    def __init__(self, spec: MimiEncoderSpec, num_codebooks: int):
        super().__init__()
        semantic = spec.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = ResidualQuantizer(spec, semantic)
        self.acoustic_residual_vector_quantizer = ResidualQuantizer(spec, num_codebooks - semantic)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        codes = self.semantic_residual_vector_quantizer(x)
        if len(self.acoustic_residual_vector_quantizer.layers):
            codes = torch.cat([codes, self.acoustic_residual_vector_quantizer(x)])
        return codes


# ---------------------------------------------------------------------------------------------------------------------
# The encoder
# ---------------------------------------------------------------------------------------------------------------------

# Checkpoint tensors an encoder never uses: decoder-side projections, a training flag, and codebooks past the valid
# count (checked separately by index).
_UNUSED = re.compile(r"(^|\.)output_proj\.weight$|\.codebook\.initialized$")
_CODEBOOK = re.compile(r"^quantizer\.(semantic|acoustic)_residual_vector_quantizer\.layers\.(\d+)\.")


class ReferenceEncoder(nn.Module):
    """The speech tokenizer's encoder half: audio -> codes [frames, encoder_valid_num_quantizers] (float32 math)."""

    def __init__(self, config: SpeechTokenizerConfig):
        super().__init__()
        spec = MimiEncoderSpec.from_dict(config.encoder)
        self.spec = spec
        self.num_quantizers = config.encoder_valid_num_quantizers
        if not spec.num_semantic_quantizers <= self.num_quantizers <= spec.num_quantizers:
            raise CheckpointError(f"encoder_valid_num_quantizers={self.num_quantizers} must lie between the "
                                  f"{spec.num_semantic_quantizers} semantic and the {spec.num_quantizers} codebooks")
        self.sample_rate = spec.sampling_rate
        self.samples_per_frame = spec.samples_per_frame
        self.encoder = SeanetEncoder(spec)
        self.encoder_transformer = EncoderTransformer(spec)
        self.downsample = None
        if spec.has_downsample:
            self.downsample = CausalConv1d(spec.hidden_size, spec.hidden_size, spec.downsample_kernel, stride=2,
                                           bias=False, pad_mode="replicate")
        self.quantizer = SplitQuantizer(spec, self.num_quantizers)
        self.eval()

    @classmethod
    def from_dir(cls, speech_tokenizer_dir: str | Path, device: str | torch.device = "cpu") -> ReferenceEncoder:
        """Build from a speech_tokenizer directory (config.json + model.safetensors), reading only `encoder.*`."""
        root = Path(speech_tokenizer_dir)
        config = parse_speech_tokenizer_config(read_json(root / "config.json"))
        with torch.device("meta"):  # no point initialising weights that are overwritten at once
            encoder = cls(config)
        load_module(encoder, read_tensors(root / "model.safetensors", CHECKPOINT_PREFIX),
                    f"{root / 'model.safetensors'} (encoder)", is_unused=encoder.is_unused_tensor)
        return encoder.to(device, torch.float32)

    def is_unused_tensor(self, name: str) -> bool:
        """Checkpoint tensors encoding never reads: output projections, init flags, codebooks past the valid count."""
        return bool(_UNUSED.search(name)) or self._is_unused_codebook(name)

    def _is_unused_codebook(self, name: str) -> bool:
        match = _CODEBOOK.match(name)
        if match is None:
            return False
        kind, index = match.group(1), int(match.group(2))
        semantic = self.spec.num_semantic_quantizers
        total = semantic if kind == "semantic" else self.spec.num_quantizers - semantic
        return index < total  # a codebook the checkpoint has but the valid count leaves out

    @property
    def device(self) -> torch.device:
        return self.quantizer.semantic_residual_vector_quantizer.layers[0].codebook.embed_sum.device

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        """wav [B, 1, T] at `sample_rate` -> codes [B, num_quantizers, ceil(T / samples_per_frame)]."""
        latents = self.encoder(wav)
        latents = self.encoder_transformer(latents.transpose(1, 2)).transpose(1, 2)
        if self.downsample is not None:
            latents = self.downsample(latents)
        return self.quantizer(latents).transpose(0, 1)

    @torch.inference_mode()
    def encode(self, audio: np.ndarray, sample_rate: int) -> torch.LongTensor:
        """Codes [frames, num_quantizers] (on this module's device) of one mono clip at any sample rate."""
        wav = resample(to_mono(audio), int(sample_rate), self.sample_rate)
        if wav.size == 0:
            raise AudioInputError("reference audio is empty")
        x = torch.from_numpy(wav).to(self.device)[None, None]
        frames = math.ceil(wav.size / self.samples_per_frame)
        return self(x)[0, :, :frames].transpose(0, 1).contiguous().long()
