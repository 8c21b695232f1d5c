"""ECAPA-TDNN speaker encoder: reference audio -> x-vector (the Base model's voice-clone speaker embedding).

Matches the reference `Qwen3TTSSpeakerEncoder` and its log-mel front end exactly. Module and parameter names mirror
the checkpoint's `speaker_encoder.*` tensors (prefix stripped), so its state dict loads as is.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.config import SpeakerEncoderConfig
from engine.errors import AudioInputError

# The mel front end the speaker encoder was trained on (fixed, not part of the config).
MEL_SAMPLE_RATE = 24000
MEL_N_FFT = 1024
MEL_HOP = 256
MEL_WIN = 1024
MEL_BINS = 128
MEL_FMIN = 0.0
MEL_FMAX = 12000.0


# ---------------------------------------------------------------------------------------------------------------------
# Mel front end
# ---------------------------------------------------------------------------------------------------------------------

def _hz_to_slaney_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's auditory mel scale: linear below 1 kHz, logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    lin_step = 200.0 / 3.0
    knee_hz, knee_mel, log_step = 1000.0, 1000.0 / lin_step, math.log(6.4) / 27.0
    mel = hz / lin_step
    above = hz >= knee_hz
    mel[above] = knee_mel + np.log(hz[above] / knee_hz) / log_step
    return mel


def _slaney_mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    lin_step = 200.0 / 3.0
    knee_hz, knee_mel, log_step = 1000.0, 1000.0 / lin_step, math.log(6.4) / 27.0
    hz = mel * lin_step
    above = mel >= knee_mel
    hz[above] = knee_hz * np.exp(log_step * (mel[above] - knee_mel))
    return hz


def slaney_mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    """Triangular, area-normalised ("slaney") mel filters [n_mels, n_fft//2+1] as float32, like librosa's default."""
    fft_hz = np.fft.rfftfreq(n_fft, d=1.0 / sample_rate)
    edges_hz = _slaney_mel_to_hz(np.linspace(_hz_to_slaney_mel(np.array([fmin]))[0],
                                             _hz_to_slaney_mel(np.array([fmax]))[0], n_mels + 2))
    widths = np.diff(edges_hz)
    rising = (fft_hz[None, :] - edges_hz[:-2, None]) / widths[:-1, None]
    falling = (edges_hz[2:, None] - fft_hz[None, :]) / widths[1:, None]
    # Rounded to float32 before and after the area normalisation, as librosa does, so the bank is bit-identical.
    filters = np.maximum(0.0, np.minimum(rising, falling)).astype(np.float32)
    filters = filters * (2.0 / (edges_hz[2:] - edges_hz[:-2]))[:, None]  # equal area per filter
    return filters.astype(np.float32)


@lru_cache(maxsize=None)
def _mel_basis_np() -> np.ndarray:
    return slaney_mel_filterbank(MEL_SAMPLE_RATE, MEL_N_FFT, MEL_BINS, MEL_FMIN, MEL_FMAX)


def speaker_mel(audio_24k: torch.Tensor) -> torch.Tensor:
    """Log-mel spectrogram [B, 128, frames] of 24 kHz audio [T] or [B, T], computed in float32.

    Frames are not centred: the signal is reflect-padded by (n_fft - hop) / 2 on each side instead, so a clip of T
    samples gives T // 256 frames.
    """
    wav = audio_24k.float()
    if wav.dim() == 1:
        wav = wav[None]
    side = (MEL_N_FFT - MEL_HOP) // 2
    wav = F.pad(wav[:, None], (side, side), mode="reflect")[:, 0]
    window = torch.hann_window(MEL_WIN, device=wav.device)
    spec = torch.stft(wav, MEL_N_FFT, hop_length=MEL_HOP, win_length=MEL_WIN, window=window, center=False,
                      normalized=False, onesided=True, return_complex=True)
    magnitude = torch.sqrt(spec.real.pow(2) + spec.imag.pow(2) + 1e-9)
    basis = torch.from_numpy(_mel_basis_np()).to(wav.device)
    return torch.log(torch.clamp(basis @ magnitude, min=1e-5))


# ---------------------------------------------------------------------------------------------------------------------
# ECAPA-TDNN
# ---------------------------------------------------------------------------------------------------------------------

def _same_conv(in_ch: int, out_ch: int, kernel_size: int = 1, dilation: int = 1) -> nn.Conv1d:
    """Every conv of the model keeps the time length and pads by reflection."""
    return nn.Conv1d(in_ch, out_ch, kernel_size, dilation=dilation, padding="same", padding_mode="reflect")


class TimeDelayBlock(nn.Module):
    """Dilated 1-D conv + ReLU (a TDNN layer)."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, dilation: int):
        super().__init__()
        self.conv = _same_conv(in_ch, out_ch, kernel_size, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class Res2NetBlock(nn.Module):
    """Splits channels into `scale` groups; group i>0 is a TDNN of (group i + output of group i-1), group 0 passes."""

    def __init__(self, channels: int, scale: int, kernel_size: int, dilation: int):
        super().__init__()
        self.scale = scale
        width = channels // scale
        self.blocks = nn.ModuleList(TimeDelayBlock(width, width, kernel_size, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = torch.chunk(x, self.scale, dim=1)
        outputs = [groups[0]]
        carry = None
        for block, group in zip(self.blocks, groups[1:]):
            carry = block(group if carry is None else group + carry)
            outputs.append(carry)
        return torch.cat(outputs, dim=1)


class SqueezeExcitation(nn.Module):
    """Channel gates from the time-averaged features."""

    def __init__(self, channels: int, bottleneck: int):
        super().__init__()
        self.conv1 = _same_conv(channels, bottleneck)
        self.conv2 = _same_conv(bottleneck, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gate


class SERes2NetBlock(nn.Module):
    """TDNN(1x1) -> Res2Net -> TDNN(1x1) -> squeeze-excitation, with a residual connection."""

    def __init__(self, in_ch: int, out_ch: int, scale: int, se_channels: int, kernel_size: int, dilation: int):
        super().__init__()
        self.tdnn1 = TimeDelayBlock(in_ch, out_ch, 1, 1)
        self.res2net_block = Res2NetBlock(out_ch, scale, kernel_size, dilation)
        self.tdnn2 = TimeDelayBlock(out_ch, out_ch, 1, 1)
        self.se_block = SqueezeExcitation(out_ch, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _weighted_stats(x: torch.Tensor, weights: torch.Tensor, eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std over time under time weights that sum to one: [B, C, T] -> 2 x [B, C]."""
    mean = (weights * x).sum(dim=2)
    var = (weights * (x - mean[:, :, None]).pow(2)).sum(dim=2)
    return mean, torch.sqrt(var.clamp(min=eps))


class AttentiveStatsPooling(nn.Module):
    """Attention over time (conditioned on the utterance's global mean/std) -> weighted mean and std."""

    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TimeDelayBlock(channels * 3, attention_channels, 1, 1)
        self.conv = _same_conv(attention_channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Uniform weights as ones / their sum in x's dtype: in bf16 the sum itself rounds (375 -> 376), and the
        # reference's x-vector carries that rounding.
        ones = torch.ones(x.shape[0], 1, x.shape[2], dtype=x.dtype, device=x.device)
        mean, std = _weighted_stats(x, ones / ones.sum(dim=2, keepdim=True))
        context = torch.cat([x, mean[:, :, None].expand_as(x), std[:, :, None].expand_as(x)], dim=1)
        attention = torch.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = _weighted_stats(x, attention)
        return torch.cat([mean, std], dim=1)[:, :, None]


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN: log-mel [B, mel_dim, frames] -> x-vector [B, enc_dim]."""

    def __init__(self, config: SpeakerEncoderConfig):
        super().__init__()
        channels, kernels, dilations = config.enc_channels, config.enc_kernel_sizes, config.enc_dilations
        if not len(channels) == len(kernels) == len(dilations):
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations must have the same length")
        self.config = config
        self.blocks = nn.ModuleList([TimeDelayBlock(config.mel_dim, channels[0], kernels[0], dilations[0])])
        for i in range(1, len(channels) - 1):
            self.blocks.append(SERes2NetBlock(channels[i - 1], channels[i], config.enc_res2net_scale,
                                              config.enc_se_channels, kernels[i], dilations[i]))
        self.mfa = TimeDelayBlock(channels[-1], channels[-1], kernels[-1], dilations[-1])
        self.asp = AttentiveStatsPooling(channels[-1], config.enc_attention_channels)
        self.fc = _same_conv(channels[-1] * 2, config.enc_dim)

    @property
    def min_frames(self) -> int:
        """Reflection padding needs more frames than the widest one-sided pad of any conv."""
        c = self.config
        return max(d * (k - 1) - d * (k - 1) // 2 for k, d in zip(c.enc_kernel_sizes, c.enc_dilations)) + 1

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = mel
        outputs = []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        # Multi-layer feature aggregation: every SE-Res2Net output, not the first TDNN's.
        x = self.mfa(torch.cat(outputs[1:], dim=1))
        return self.fc(self.asp(x))[:, :, 0]

    @torch.inference_mode()
    def embed(self, audio_24k: np.ndarray) -> torch.Tensor:
        """The x-vector [enc_dim] of one mono 24 kHz clip, in the model's dtype and on its device."""
        weight = self.fc.weight
        wav = torch.from_numpy(np.ascontiguousarray(audio_24k, dtype=np.float32)).to(weight.device)
        if wav.dim() != 1:
            raise AudioInputError(f"speaker embedding needs mono audio, got shape {tuple(audio_24k.shape)}")
        mel = speaker_mel(wav)
        if mel.shape[2] < self.min_frames:
            seconds = self.min_frames * MEL_HOP / MEL_SAMPLE_RATE
            raise AudioInputError(f"reference audio is too short for a speaker embedding (need {seconds:.2f} s)")
        return self(mel.to(weight.dtype))[0]
