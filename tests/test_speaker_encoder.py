"""Our ECAPA-TDNN speaker encoder and mel front end against the reference qwen-tts implementation."""
from __future__ import annotations

import librosa
import numpy as np
import pytest
import torch

import tests.reference  # noqa: F401  (the reference package, importable through its torchaudio shim)

# isort: split

from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig
from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSSpeakerEncoder, mel_spectrogram

from engine.checkpoint import load_module
from engine.config import SpeakerEncoderConfig
from engine.errors import AudioInputError, CheckpointError
from engine.model.speaker_encoder import SpeakerEncoder, slaney_mel_filterbank, speaker_mel
from engine.synthetic.configs import TINY_SPEAKER_ENCODER

pytestmark = pytest.mark.usefixtures("one_thread")


def _speech_like(seconds: float, sr: int = 24000, seed: int = 0) -> np.ndarray:
    """A few modulated harmonics plus noise, peak below 1 (the reference warns outside [-1, 1])."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    f0 = 140 + 30 * np.sin(2 * np.pi * 1.3 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    wav = sum(np.sin(k * phase) / k for k in range(1, 8)) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))
    wav = wav + 0.05 * rng.standard_normal(t.size)
    return (0.5 * wav / np.abs(wav).max()).astype(np.float32)


def _tiny_pair() -> tuple[Qwen3TTSSpeakerEncoder, SpeakerEncoder]:
    reference = Qwen3TTSSpeakerEncoder(Qwen3TTSSpeakerEncoderConfig(**TINY_SPEAKER_ENCODER, enc_dim=64)).eval()
    torch.manual_seed(0)
    state = {k: torch.randn_like(v) * 0.3 for k, v in reference.state_dict().items()}
    reference.load_state_dict(state)
    ours = SpeakerEncoder(SpeakerEncoderConfig(**TINY_SPEAKER_ENCODER, enc_dim=64)).eval()
    load_module(ours, state, "speaker encoder")
    return reference, ours


def test_mel_filterbank_equals_librosa():
    for sr, n_fft, n_mels, fmin, fmax in [(24000, 1024, 128, 0, 12000), (16000, 512, 80, 20, 7600),
                                          (22050, 2048, 64, 0, 11025)]:
        ours = slaney_mel_filterbank(sr, n_fft, n_mels, fmin, fmax)
        ref = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax)
        assert ours.dtype == np.float32 and ours.shape == ref.shape
        np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6)
        assert np.array_equal(ours, ref)  # bit-identical, float32 rounding steps included


def test_mel_equals_reference():
    wav = _speech_like(1.5)
    ref = mel_spectrogram(torch.from_numpy(wav)[None], n_fft=1024, num_mels=128, sampling_rate=24000, hop_size=256,
                          win_size=1024, fmin=0, fmax=12000)
    ours = speaker_mel(torch.from_numpy(wav))
    assert ours.shape == ref.shape == (1, 128, wav.size // 256)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_state_dict_names_match_reference():
    reference, ours = _tiny_pair()
    ref_shapes = {k: v.shape for k, v in reference.state_dict().items()}
    assert {k: v.shape for k, v in ours.state_dict().items()} == ref_shapes
    for name in ("blocks.0.conv.weight", "blocks.1.tdnn1.conv.weight", "blocks.1.res2net_block.blocks.0.conv.weight",
                 "blocks.1.se_block.conv1.weight", "mfa.conv.weight", "asp.tdnn.conv.weight", "asp.conv.weight",
                 "fc.weight"):
        assert name in ref_shapes


def test_xvector_equals_reference():
    reference, ours = _tiny_pair()
    wav = _speech_like(1.5, seed=1)
    with torch.inference_mode():
        mel = mel_spectrogram(torch.from_numpy(wav)[None], n_fft=1024, num_mels=128, sampling_rate=24000,
                              hop_size=256, win_size=1024, fmin=0, fmax=12000).transpose(1, 2)
        expected = reference(mel)[0]  # what Qwen3TTSForConditionalGeneration.extract_speaker_embedding returns
    got = ours.embed(wav)
    assert got.shape == (64,) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_bf16_xvector_is_bit_identical_to_reference():
    """The deployed dtype. 1.6 s gives 150 mel frames; a frame count that bf16 cannot hold (e.g. 375 -> 376) makes
    the reference's uniform pooling weights 1/376, which ours must reproduce."""
    reference, ours = _tiny_pair()
    reference, ours = reference.to(torch.bfloat16), ours.to(torch.bfloat16)
    for seconds in (1.6, 4.0):  # 150 and 375 frames
        wav = _speech_like(seconds, seed=4)
        with torch.inference_mode():
            mel = mel_spectrogram(torch.from_numpy(wav)[None], n_fft=1024, num_mels=128, sampling_rate=24000,
                                  hop_size=256, win_size=1024, fmin=0, fmax=12000).transpose(1, 2)
            expected = reference(mel.to(torch.bfloat16))[0]
        got = ours.embed(wav)
        assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


def test_batched_forward_matches_single():
    _, ours = _tiny_pair()
    wavs = np.stack([_speech_like(1.0, seed=s) for s in (2, 3)])
    with torch.inference_mode():
        batch = ours(speaker_mel(torch.from_numpy(wavs)))
    torch.testing.assert_close(batch[1], ours.embed(wavs[1]), rtol=1e-5, atol=1e-6)


def test_too_short_or_stereo_audio_is_rejected():
    _, ours = _tiny_pair()
    with pytest.raises(AudioInputError, match="too short"):
        ours.embed(np.zeros(512, dtype=np.float32))
    with pytest.raises(AudioInputError, match="mono"):
        ours.embed(np.zeros((24000, 2), dtype=np.float32))


def test_load_weights_names_bad_tensors():
    reference, ours = _tiny_pair()
    state = dict(reference.state_dict())
    del state["fc.bias"]
    with pytest.raises(CheckpointError, match=r"missing tensors fc\.bias"):
        load_module(ours, state, "speaker encoder")
    state = dict(reference.state_dict(), **{"asp.conv.weight": torch.zeros(3, 3, 1)})
    with pytest.raises(CheckpointError, match=r"asp\.conv\.weight has shape \(3, 3, 1\)"):
        load_module(ours, state, "speaker encoder")


@pytest.mark.parametrize("enc_dim", [1024, 2048])
def test_real_size_builds_on_meta_like_reference(enc_dim):
    with torch.device("meta"):
        reference = Qwen3TTSSpeakerEncoder(Qwen3TTSSpeakerEncoderConfig(enc_dim=enc_dim))
        ours = SpeakerEncoder(SpeakerEncoderConfig(enc_dim=enc_dim))
    assert next(ours.parameters()).is_meta
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in reference.state_dict().items()}
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in reference.parameters())
    assert count > 5_000_000  # 512-channel ECAPA-TDNN plus a 3072 x enc_dim output projection
