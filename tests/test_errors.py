"""Bad input gets a clear error naming the problem (a VoxgateError, never a traceback from deep inside)."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.errors import AudioInputError, CheckpointError, RequestError
from engine.tts import TTSModel, VoiceRequest


@pytest.fixture(scope="module")
def models(tiny_checkpoints):
    return {variant: TTSModel.load(path) for variant, path in tiny_checkpoints.items()}


def test_unknown_speaker_lists_the_valid_ones(models):
    with pytest.raises(RequestError, match="unknown speaker 'nobody'.*vivian"):
        models["custom_voice"].voice(VoiceRequest(speaker="nobody"))


def test_speaker_names_are_case_insensitive(models):
    assert models["custom_voice"].voice(VoiceRequest(speaker="ViViAn")).speaker == "vivian"


def test_speaker_given_to_voice_design_model(models):
    with pytest.raises(RequestError, match="voice_design model has no built-in speakers"):
        models["voice_design"].voice(VoiceRequest(speaker="vivian", instruct="A calm voice."))


def test_voice_design_needs_an_instruction(models):
    with pytest.raises(RequestError, match="needs an instruction"):
        models["voice_design"].voice(VoiceRequest())


def test_reference_audio_given_to_custom_voice_model(models, ref_audio):
    with pytest.raises(RequestError, match="reference audio is for voice cloning"):
        models["custom_voice"].voice(VoiceRequest(speaker="vivian", ref_audio=ref_audio))


def test_base_model_needs_reference_audio_and_transcript(models, ref_audio):
    with pytest.raises(RequestError, match="give a reference audio"):
        models["base"].voice(VoiceRequest())
    with pytest.raises(RequestError, match="transcript"):
        models["base"].voice(VoiceRequest(ref_audio=ref_audio))


@pytest.mark.parametrize("text", ["", "   \n"])
def test_empty_text(models, text):
    tts = models["custom_voice"]
    with pytest.raises(RequestError, match="text is empty"):
        tts.synthesize(text, tts.voice(VoiceRequest(speaker="vivian")))


def test_languages_accept_names_case_insensitively_and_iso_codes(models):
    tts = models["custom_voice"]
    assert tts.resolve_language("English") == "english"
    assert tts.resolve_language("zh") == "chinese"
    assert tts.resolve_language("AUTO") == "auto"
    with pytest.raises(RequestError, match="unknown language 'klingon'.*english"):
        tts.resolve_language("klingon")


def test_unreadable_reference_audio(models, tmp_path):
    bad = tmp_path / "noise.wav"
    bad.write_bytes(b"this is not audio at all")
    with pytest.raises(AudioInputError, match="noise.wav"):
        models["base"].voice(VoiceRequest(ref_audio=bad, ref_text="hello"))
    with pytest.raises(AudioInputError, match="not found"):
        models["base"].voice(VoiceRequest(ref_audio=tmp_path / "missing.wav", ref_text="hello"))


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "model.safetensors", "vocab.json",
                                  "speech_tokenizer/config.json", "speech_tokenizer/model.safetensors"])
def test_missing_checkpoint_file_is_named(tiny_checkpoints, tmp_path, name):
    path = copy_checkpoint(tiny_checkpoints["custom_voice"], tmp_path / "ckpt")
    (path / name).unlink()
    with pytest.raises(CheckpointError, match=f"missing checkpoint file: .*{name}"):
        TTSModel.load(path)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "speech_tokenizer/model.safetensors",
                                  "tokenizer_config.json"])
def test_malformed_checkpoint_file_is_named(tiny_checkpoints, tmp_path, name):
    path = copy_checkpoint(tiny_checkpoints["custom_voice"], tmp_path / "ckpt")
    (path / name).write_bytes(b"\x00garbage{")
    with pytest.raises(CheckpointError, match=f"malformed .*{Path(name).name}"):
        TTSModel.load(path)


def test_config_that_does_not_fit_the_weights(tiny_checkpoints, tmp_path):
    path = copy_checkpoint(tiny_checkpoints["custom_voice"], tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["talker_config"]["num_hidden_layers"] += 1
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="missing tensors .*layers.2"):
        TTSModel.load(path)


def test_config_field_of_the_wrong_type_names_the_file(tiny_checkpoints, tmp_path):
    path = copy_checkpoint(tiny_checkpoints["custom_voice"], tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["talker_config"]["spk_id"] = ["not", "a", "map"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="malformed checkpoint file .*config.json"):
        TTSModel.load(path)


def test_missing_model_directory(tmp_path):
    with pytest.raises(CheckpointError, match="model directory not found"):
        TTSModel.load(tmp_path / "nowhere")


def test_runaway_guard_bounds_generation(models):
    """A random model rarely emits EOS; without max_frames the text-length guard stops it."""
    tts = models["custom_voice"]
    result = tts.synthesize("Two words.", tts.voice(VoiceRequest(speaker="vivian")))
    _, text_ids = tts.tokenizer.target("Two words.")
    assert 0 < result.codes.shape[0] <= max(25, 10 * len(text_ids))
    assert len(result.audio) == result.codes.shape[0] * 1920
    assert np.isfinite(result.audio).all()
