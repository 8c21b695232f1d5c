"""Self-test of the reference harness: our tokenizer files load in the reference, tiny checkpoints build, load and
generate non-degenerate greedy output in every mode."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.synthetic.tokenizer_files import SPECIAL_TOKENS, special_token_ids, write_tokenizer_files

FRAMES = 8
SAMPLES_PER_FRAME = 1920
# No mixed-case words (iPhone): from a local checkpoint the reference swaps in the Mistral split regex, which
# splits them differently from the Qwen regex.
TEXTS = ["Hello world, this is a test.", "你好，世界！今天天气很好。", "The year 2024 had 366 days; pi≈3.14159...",
         "  leading spaces\n\nand newlines\r\n", "don't we'll they're I'M OK", "Émile naïve café — «quotes» “smart”",
         "日本語のテキストです。한국어 텍스트입니다.", "Привет, мир! ¿qué tal?", "100% @#$%^&*() x = f(y) + 3*z/2",
         "emoji 😀👍🏽 ©®™", "mixed 中文english123混合", "   ", "!!!???...",
         "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>assistant\n", "<|im_start|>user\nA calm voice.<|im_end|>\n"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen_tokenizer")
    write_tokenizer_files(out)
    return out


def test_tokenizer_files_layout(tokenizer_dir: Path) -> None:
    assert sorted(p.name for p in tokenizer_dir.iterdir()) == ["merges.txt", "tokenizer_config.json", "vocab.json"]
    assert special_token_ids()["<tts_pad>"] == 151671 and len(SPECIAL_TOKENS) == 33


def test_tokenizer_files_module_does_not_import_transformers() -> None:
    code = "import sys, engine.synthetic.tokenizer_files; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_transformers_loads_tokenizer_files(tokenizer_dir: Path) -> None:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert tok.convert_tokens_to_ids("<|im_start|>") == 151644
    assert tok.convert_tokens_to_ids("<tts_pad>") == 151671
    assert tok.convert_tokens_to_ids("<|audio_pad|>") == 151675
    assert tok("Hello")["input_ids"] == [9707]
    assert tok("assistant")["input_ids"] == [77091]
    assert tok("\n")["input_ids"] == [198]
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)


def test_engine_tokenizer_matches_transformers(tokenizer_dir: Path) -> None:
    """Our runtime tokenizer (`tokenizers` alone, from the checkpoint files) gives transformers' ids."""
    import transformers

    from engine.text.tokenizer import TextTokenizer, load_tokenizer

    ours = TextTokenizer(load_tokenizer(tokenizer_dir))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], text


def test_reference_processor_matches_on_plain_text(reference_models: dict, tokenizer_dir: Path) -> None:
    """The reference's processor (Mistral regex patched in) agrees with the Qwen regex away from mixed case."""
    import transformers

    plain = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    processor = reference_models["custom_voice"].processor
    for text in TEXTS:
        assert processor(text=text)["input_ids"][0] == plain(text)["input_ids"], text


def test_reference_processor_splits_mixed_case_words(reference_models: dict, tokenizer_dir: Path) -> None:
    """Documents a reference quirk: loading a local checkpoint whose config.json says transformers 4.57.3 swaps the
    Qwen split regex for the Mistral one (`fix_mistral_regex=True`), which splits camel-case words."""
    import transformers

    plain = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    processor = reference_models["custom_voice"].processor
    assert plain("iPhone")["input_ids"] == [44740]
    assert processor(text="iPhone")["input_ids"][0] == [72, 6939]  # "i" + "Phone"


CASES = [("custom_voice", "custom_voice", dict(speaker="vivian", instruct="Speak slowly.")),
         ("custom_voice", "custom_voice", dict(speaker="eric", language="chinese")),  # dialect speaker
         ("voice_design", "voice_design", dict(instruct="A deep, calm voice.")),
         ("base", "clone_xvector", {}),
         ("base", "clone_icl", dict(ref_text="This is the reference transcript."))]


@pytest.mark.parametrize("non_streaming_mode", [False, True])
@pytest.mark.parametrize("variant,mode,kwargs", CASES, ids=[f"{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_reference_generate(reference_models: dict, ref_audio: tuple, variant: str, mode: str, kwargs: dict,
                            non_streaming_mode: bool) -> None:
    from tests.reference import reference_generate

    if mode.startswith("clone"):
        kwargs = dict(kwargs, ref_audio=ref_audio)
    codes, wav, ref_codes = reference_generate(reference_models[variant], mode, "Hello world, this is a test.",
                                               non_streaming_mode=non_streaming_mode, frames=FRAMES, **kwargs)
    assert codes.dtype == np.int64 and codes.ndim == 2 and codes.shape[1] == 16
    assert 2 <= codes.shape[0] <= FRAMES  # min_new_tokens=2 bans EOS for the first two steps
    assert codes.min() >= 0 and codes.max() < 2048
    assert len(set(codes[:, 0].tolist())) > 1, "greedy decoding collapsed to one token"
    assert wav.dtype == np.float32
    if mode == "clone_icl":
        assert ref_codes is not None and ref_codes.shape == (25, 16)  # 2.0 s at 12.5 Hz
        assert abs(len(wav) - codes.shape[0] * SAMPLES_PER_FRAME) <= 1  # the wrapper cuts at a rounded fraction
    else:
        assert ref_codes is None
        assert len(wav) == codes.shape[0] * SAMPLES_PER_FRAME
    assert float(np.sqrt(np.mean(wav ** 2))) > 1e-2
    assert float(np.mean(np.abs(wav) >= 1.0)) < 0.01


def test_reference_checkpoint_is_deterministic(tmp_path: Path, reference_checkpoints: dict) -> None:
    from safetensors.torch import load_file

    from tests.reference import build_reference_checkpoint

    again = build_reference_checkpoint(tmp_path / "base", "base", seed=0)
    for name in ("model.safetensors", "speech_tokenizer/model.safetensors"):
        first, second = load_file(reference_checkpoints["base"] / name), load_file(again / name)
        assert first.keys() == second.keys()
        assert all((first[k] == second[k]).all() for k in first), name
    seed0 = load_file(again / "model.safetensors")
    seed1 = load_file(build_reference_checkpoint(tmp_path / "seed1", "base", seed=1) / "model.safetensors")
    assert not (seed1["talker.codec_head.weight"] == seed0["talker.codec_head.weight"]).all()
