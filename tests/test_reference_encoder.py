"""Reference-audio encoder (Mimi, encoder half) against the reference qwen-tts speech tokenizer, and audio loading."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import librosa
import numpy as np
import pytest
import soundfile as sf
import torch

import tests.reference  # noqa: F401  (the reference package, importable through its torchaudio shim)

# isort: split

from qwen_tts import Qwen3TTSTokenizer
from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model
from safetensors import safe_open
from safetensors.torch import load_file

from engine.checkpoint import load_module
from engine.config import parse_speech_tokenizer_config, read_json
from engine.errors import AudioInputError, CheckpointError
from engine.model.reference_encoder import ReferenceEncoder, decode_reference_audio, load_reference_audio, resample
from engine.synthetic.configs import SPEECH_PREPROCESSOR, speech_tokenizer_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny_config() -> dict:
    config = speech_tokenizer_config("tiny")
    encoder = config["encoder_config"]
    # Two Mimi defaults only fit the real widths (no-ops once model_configs.TINY_ENCODER sets them): the decoder-side
    # ConvTranspose has upsample_groups=512 groups, which must divide hidden_size, and the quantizer projects to
    # vector_quantization_hidden_dimension=256, which must equal codebook_dim.
    encoder.setdefault("upsample_groups", encoder["hidden_size"])
    encoder.setdefault("vector_quantization_hidden_dimension", encoder["codebook_dim"])
    return config


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**_tiny_config()))
    with torch.no_grad():
        for name, buf in model.named_buffers():  # Mimi's codebooks start all-zero: random centroids
            if name.startswith("encoder.quantizer") and name.endswith("embed_sum"):
                buf.copy_(torch.randn_like(buf))
        for name, param in model.named_parameters():  # Mimi's init leaves the transformer a near no-op: wake it up
            if name.startswith("encoder.encoder_transformer") and name.endswith("layer_scale.scale"):
                param.copy_(torch.rand_like(param) + 0.5)
            elif name.startswith("encoder.encoder_transformer") and name.endswith(("proj.weight", "fc1.weight",
                                                                                  "fc2.weight")):
                param.normal_(0.0, param.shape[1] ** -0.5)
    path = tmp_path_factory.mktemp("speech_tokenizer")
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(SPEECH_PREPROCESSOR))
    return path


@pytest.fixture(scope="module")
def reference(tokenizer_dir) -> Qwen3TTSTokenizer:
    return Qwen3TTSTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="module")
def ours(tokenizer_dir) -> ReferenceEncoder:
    return ReferenceEncoder.from_dir(tokenizer_dir)


def _signal(seconds: float, sr: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * sr))) / sr
    wav = 0.3 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 2 * t) + 0.1 * rng.standard_normal(t.size)
    return wav.astype(np.float32)


@pytest.mark.parametrize("sr, seconds", [(24000, 2.0), (16000, 2.0), (44100, 1.23), (24000, 1.0 + 7 / 24000)])
def test_codes_equal_reference(reference, ours, sr, seconds):
    wav = _signal(seconds, sr, seed=sr)
    expected = reference.encode(wav, sr=sr).audio_codes[0]
    got = ours.encode(wav, sr)
    n24 = resample(wav, sr, 24000).size
    assert got.dtype == torch.long and got.shape == (int(np.ceil(n24 / 1920)), 16)
    assert torch.equal(got, expected)
    assert len(torch.unique(got[:, 0])) > 1  # the comparison is not vacuous


def test_long_clip_equals_reference(reference, ours):
    """Over 10 s the SEANet output exceeds Mimi's 250-step `sliding_window`, which the reference's transformers
    (4.57) does not apply: attention stays fully causal (a 250-step window changes these codes)."""
    wav = _signal(12.0, 24000, seed=7)
    expected = reference.encode(wav, sr=24000).audio_codes[0]
    assert torch.equal(ours.encode(wav, 24000), expected)


def test_real_size_layout_matches_reference_on_meta():
    config = speech_tokenizer_config("0b6")
    with torch.device("meta"):
        reference = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**config))
        ours = ReferenceEncoder(parse_speech_tokenizer_config(config))
    theirs = {k.removeprefix("encoder."): v.shape for k, v in reference.state_dict().items()
              if k.startswith("encoder.")}
    mine = {k: v.shape for k, v in ours.state_dict().items()}
    assert all(theirs.get(k) == shape for k, shape in mine.items())
    assert "quantizer.acoustic_residual_vector_quantizer.input_proj.weight" in mine  # 512 -> 256 projection
    assert ours.samples_per_frame == 1920 and ours.num_quantizers == 16


def test_stereo_numpy_input_is_downmixed_like_reference(reference, ours):
    wav = np.stack([_signal(1.0, 24000, 1), _signal(1.0, 24000, 2)], axis=1)  # [T, 2]
    assert torch.equal(ours.encode(wav, 24000), reference.encode(wav, sr=24000).audio_codes[0])


def test_resample_equals_librosa():
    # 54243 samples at 44.1 kHz: librosa's float ratio makes ceil(n * ratio) 29521, not the exact 29520.
    for sr, n in [(8000, 6161), (16000, 32001), (22050, 16977), (44100, 54243), (48000, 36961), (24000, 5000)]:
        wav = _signal(n / sr, sr, seed=sr)
        expected = librosa.resample(wav, orig_sr=sr, target_sr=24000)
        got = resample(wav, sr, 24000)
        assert got.dtype == np.float32 and np.array_equal(got, expected)


def test_feature_extractor_is_identity_for_one_mono_clip(reference):
    wav = _signal(1.3, 24000)
    features = reference.feature_extractor(raw_audio=[wav], sampling_rate=24000, return_tensors="pt")
    assert features["input_values"].shape == (1, 1, wav.size)
    assert np.array_equal(features["input_values"][0, 0].numpy(), wav)
    assert bool(features["padding_mask"].all())


def test_state_dict_names_are_the_checkpoint_encoder_names(tokenizer_dir, ours):
    with safe_open(str(tokenizer_dir / "model.safetensors"), framework="pt") as f:
        checkpoint = {k.removeprefix("encoder.") for k in f.keys() if k.startswith("encoder.")}
    ours_names = set(ours.state_dict())
    assert ours_names <= checkpoint
    # what the checkpoint has beyond ours: acoustic codebooks 15..30 (past the 1 + 15 valid ones), the decoder-side
    # output projections, and the codebooks' `initialized` flags
    def unused(name: str) -> bool:
        late = re.match(r"quantizer\.acoustic_residual_vector_quantizer\.layers\.(\d+)\.", name)
        return name.endswith((".initialized", "output_proj.weight")) or (late is not None and int(late[1]) >= 15)

    assert all(unused(k) for k in checkpoint - ours_names), sorted(checkpoint - ours_names)
    assert {k.split(".")[0] for k in ours_names} == {"encoder", "encoder_transformer", "downsample", "quantizer"}


def test_bad_weights_are_named(tokenizer_dir):
    tensors = load_file(str(tokenizer_dir / "model.safetensors"))
    key = "encoder.downsample.conv.weight"
    assert key in tensors
    bad = dict(tensors)
    bad[key] = bad[key][:, :1]
    del bad["encoder.encoder_transformer.layers.0.mlp.fc1.weight"]
    encoder = ReferenceEncoder(parse_speech_tokenizer_config(read_json(tokenizer_dir / "config.json")))

    def load(state):
        encoder_state = {k.removeprefix("encoder."): v for k, v in state.items() if k.startswith("encoder.")}
        load_module(encoder, encoder_state, "encoder", is_unused=encoder.is_unused_tensor)

    with pytest.raises(CheckpointError, match=r"missing tensors encoder_transformer\.layers\.0\.mlp\.fc1\.weight"):
        load(bad)
    bad["encoder.encoder_transformer.layers.0.mlp.fc1.weight"] = tensors["encoder.encoder_transformer.layers.0.mlp.fc1.weight"]
    with pytest.raises(CheckpointError, match=r"downsample\.conv\.weight has shape"):
        load(bad)
    stray = dict(tensors)
    stray["encoder.encoder_transformer.layers.7.mlp.fc1.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match=r"unexpected tensors encoder_transformer\.layers\.7"):
        load(stray)
    with pytest.raises(CheckpointError, match="missing checkpoint file"):
        ReferenceEncoder.from_dir(tokenizer_dir / "nowhere")


# ---------------------------------------------------------------------------------------------------------------------
# load_reference_audio
# ---------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, ext", [("WAV", "wav"), ("FLAC", "flac"), ("OGG", "ogg")])
def test_load_reference_audio_formats(tmp_path, fmt, ext):
    wav = _signal(0.8, 16000)
    path = tmp_path / f"ref.{ext}"
    sf.write(path, np.stack([wav, 0.5 * wav], axis=1), 16000, format=fmt)
    audio, sr = load_reference_audio(path)
    assert sr == 16000 and audio.dtype == np.float32 and audio.shape == wav.shape
    expected, _ = librosa.load(path, sr=None, mono=True)  # what the reference reads
    np.testing.assert_array_equal(audio, expected)


@pytest.mark.parametrize("rate, peak, refused", [
    (1, 0.5, "sample rate of 1 Hz"), (4000, 0.5, "sample rate of 4000 Hz"),  # a 1 Hz WAV of 2 samples was a voice
    (16000, 1e6, "samples up to 1e"), (16000, 2.5, "samples up to 2.5"),
    (8000, 0.5, None), (16000, 1.5, None),  # telephone speech; float audio a little past full scale
    (655350, 0.5, "sample rate of 655350 Hz"), (192000, 0.5, None),  # a decompression bomb's rate; a studio's
])
def test_reference_audio_that_is_not_speech_is_refused(tmp_path, rate, peak, refused):
    path = tmp_path / "odd.wav"
    signal = np.sin(np.linspace(0, 200, 2 * rate)).astype(np.float32) * peak
    sf.write(path, signal, rate, subtype="FLOAT")
    if refused is None:
        assert load_reference_audio(path)[1] == rate
    else:
        with pytest.raises(AudioInputError, match=re.escape(refused)):
            load_reference_audio(path)


@pytest.mark.parametrize("channels", [1, 2, 8, 9])
def test_a_file_of_up_to_8_channels_is_mixed_to_mono_and_more_are_refused(tmp_path, channels):
    """A file is decoded whole, all its channels at once: past 8 (7.1) it is refused before decoding (an Ogg Vorbis
    file may have 255: a small upload would expand to gigabytes)."""
    rng = np.random.default_rng(channels)
    audio = rng.uniform(-0.5, 0.5, (16000, channels)).astype(np.float32)
    path = tmp_path / "multi.wav"
    sf.write(path, audio, 16000, subtype="FLOAT")
    if channels > 8:
        with pytest.raises(AudioInputError, match="has 9 channels; at most 8"):
            decode_reference_audio(path.read_bytes(), "upload")
        return
    mono, _ = decode_reference_audio(path.read_bytes(), "upload")
    np.testing.assert_array_equal(mono, audio.mean(axis=1) if channels > 1 else audio[:, 0])


def test_a_file_shorter_than_its_header_says_gives_only_what_it_holds():
    """An MP3 cut in half still says its whole length in its header: the samples are what decodes, no more (reading
    by the header's count padded the rest with the read buffer's stale samples, which became part of the voice)."""
    rate = 44100
    signal = (0.3 * np.sin(2 * np.pi * 220 * np.arange(6 * rate) / rate)).astype(np.float32)
    whole = io.BytesIO()
    sf.write(whole, np.stack([signal, 0.5 * signal], axis=1), rate, format="MP3")
    cut = whole.getvalue()[:len(whole.getvalue()) // 2]
    with sf.SoundFile(io.BytesIO(cut)) as file:
        header_frames, held = file.frames, file.read(dtype="float32", always_2d=True)
    assert len(held) < header_frames  # the header says more than there is
    mono, _ = decode_reference_audio(cut, "upload")
    np.testing.assert_array_equal(mono, held.mean(axis=1))


def _unrecorded_length(flac: bytes) -> bytes:
    """The FLAC with its STREAMINFO's total samples zeroed: "unknown", as a FLAC written to a pipe says (FFmpeg's)."""
    assert flac[:4] == b"fLaC"
    fields = int.from_bytes(flac[18:26], "big") & ~((1 << 36) - 1)  # rate, channels, bits, then 36 bits of samples
    return flac[:18] + fields.to_bytes(8, "big") + flac[26:]


@pytest.mark.parametrize("seconds, channels, subtype", [(3.0, 1, "PCM_16"), (2.5, 2, "PCM_24"), (31.0, 1, "PCM_16")])
def test_a_flac_that_does_not_record_its_length_decodes_within_the_bound(seconds, channels, subtype):
    """libsndfile reads such a file as endless, so it was refused as too long whatever its length (a hostile try's
    streamed upload), and its reads fail at its end. It decodes to the samples of the same FLAC with its length
    recorded; past the bound it is refused as too long once the decode passes it, not after."""
    rate = 24000
    signal = (0.3 * np.sin(2 * np.pi * 180 * np.arange(int(seconds * rate)) / rate)).astype(np.float32)
    recorded = io.BytesIO()
    sf.write(recorded, np.stack([signal, 0.5 * signal], axis=1) if channels == 2 else signal, rate, format="FLAC",
             subtype=subtype)
    unrecorded = _unrecorded_length(recorded.getvalue())
    with sf.SoundFile(io.BytesIO(unrecorded)) as file:
        assert file.frames == 2**63 - 1  # libsndfile's "endless"
    if seconds > 30:
        with pytest.raises(AudioInputError, match=re.escape("too long (over 30 s); at most 30 s")):
            decode_reference_audio(unrecorded, "upload", max_seconds=30.0)
        return
    mono, got_rate = decode_reference_audio(unrecorded, "upload", max_seconds=30.0)
    expected, _ = decode_reference_audio(recorded.getvalue(), "upload", max_seconds=30.0)
    assert got_rate == rate and len(mono) == len(signal)
    np.testing.assert_array_equal(mono, expected)


def test_load_reference_audio_errors(tmp_path):
    with pytest.raises(AudioInputError, match="not found.*missing.wav"):
        load_reference_audio(tmp_path / "missing.wav")
    garbage = tmp_path / "garbage.wav"
    garbage.write_bytes(b"this is not audio at all" * 10)
    with pytest.raises(AudioInputError, match="cannot read.*garbage.wav"):
        load_reference_audio(garbage)
    corrupt = tmp_path / "corrupt.mp3"  # an MP3 frame's header, then junk: libsndfile calls it "not a regular file"
    corrupt.write_bytes(b"\xff\xfb\x90\x00" + bytes(range(256)) * 16)
    with pytest.raises(AudioInputError, match="cannot read.*corrupt.mp3: none of the decoders can read it") as told:
        load_reference_audio(corrupt)
    assert "pipe" not in str(told.value)
    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros(0, dtype=np.float32), 24000)
    with pytest.raises(AudioInputError, match="empty.wav is empty"):
        load_reference_audio(empty)
    short = tmp_path / "short.wav"
    sf.write(short, np.zeros(11999, dtype=np.float32), 24000)
    with pytest.raises(AudioInputError, match=r"short.wav is too short \(0.499 s\)"):  # never shown as 0.50
        load_reference_audio(short)
    with pytest.raises(AudioInputError, match=r"is too long \(2.001 s\); at most 2 s"):  # was "(2.0 s); at most 2 s"
        decode_reference_audio(_wav_bytes(np.zeros(48010, dtype=np.float32), 24000), "long", max_seconds=2)
    directory = tmp_path / "dir.wav"
    directory.mkdir()
    with pytest.raises(AudioInputError, match="not found"):
        load_reference_audio(directory)
    broken = tmp_path / "nan.wav"
    sf.write(broken, np.full(12000, np.nan, dtype=np.float32), 24000, subtype="FLOAT")
    with pytest.raises(AudioInputError, match="nan.wav contains NaN"):
        load_reference_audio(broken)
    silent = tmp_path / "silent.wav"
    sf.write(silent, np.zeros(12000, dtype=np.float32), 24000)  # exactly 0.5 s of silence is accepted
    audio, sr = load_reference_audio(silent)
    assert audio.shape == (12000,) and sr == 24000


def _wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    out = io.BytesIO()
    sf.write(out, samples, rate, format="WAV")
    return out.getvalue()
