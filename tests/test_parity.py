"""Parity with the reference implementation (qwen-tts 0.1.1) on tiny random checkpoints written with its own classes:
greedy codes identical frame for frame, waveform within 1e-4 relative error (fp32, CPU), all four modes, both text
layouts."""
import numpy as np
import pytest
import torch

from engine.sampling import SamplingParams
from engine.tts import TTSModel, VoiceRequest
from tests.reference import load_reference, reference_generate

TEXT = "Hello world, this is a quick test of the speech system: 42 apples. 你好，世界！"
REF_TEXT = "The reference speaker reads this sentence."
FRAMES = 40
CASES = [  # (mode, variant, language, voice request)
    ("custom_voice", "custom_voice", "English", dict(speaker="Vivian", instruct="Speak a little faster.")),
    ("custom_voice", "custom_voice", "Auto", dict(speaker="Eric")),  # a dialect speaker: Sichuanese under auto
    ("voice_design", "voice_design", "Chinese", dict(instruct="A deep, calm male voice.")),
    ("clone_xvector", "base", "English", dict(x_vector_only=True)),
    ("clone_icl", "base", "English", dict(ref_text=REF_TEXT)),
]


@pytest.fixture(scope="module")
def models(reference_checkpoints):
    loaded = {}

    def get(variant: str):
        if variant not in loaded:
            path = reference_checkpoints[variant]
            loaded[variant] = (load_reference(path), TTSModel.load(path))
        return loaded[variant]

    return get


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("layout", ["prefill", "streaming"])
@pytest.mark.parametrize("mode,variant,language,request_args", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_greedy_parity(models, ref_audio, mode, variant, language, request_args, layout):
    reference, ours = models(variant)
    clone = variant == "base"
    ref_codes, ref_wav, ref_prompt_codes = reference_generate(
        reference, mode, TEXT, speaker=request_args.get("speaker"), instruct=request_args.get("instruct"),
        ref_audio=ref_audio if clone else None, ref_text=request_args.get("ref_text"), language=language,
        non_streaming_mode=layout == "prefill", frames=FRAMES)
    voice = ours.voice(VoiceRequest(ref_audio=ref_audio if clone else None, **request_args))
    greedy = SamplingParams.from_defaults(ours.config.generation, greedy=True)
    result = ours.synthesize(TEXT, voice, language=language, layout=layout, sampling=greedy, max_frames=FRAMES)

    assert len(ref_codes) >= 10, "the reference stopped too early for a meaningful comparison"
    if mode == "clone_icl":
        np.testing.assert_array_equal(voice.ref_codes.cpu().numpy(), ref_prompt_codes)
        assert len(ref_prompt_codes) + FRAMES <= 300  # the reference decodes in 300-frame chunks
    np.testing.assert_array_equal(result.codes.numpy(), ref_codes)

    assert len(result.audio) == len(ref_codes) * 1920
    # For voice cloning the reference cuts the reference frames' audio at a float-rounded sample index
    # (int(ref_len / total * samples)), which can keep one sample more than the exact cut we make.
    extra = len(ref_wav) - len(result.audio)
    assert extra in ((0, 1) if mode == "clone_icl" else (0,))
    assert np.sqrt(np.mean(ref_wav ** 2)) > 1e-2  # the reference audio is not near-silence
    assert relative_error(result.audio, ref_wav[extra:]) < 1e-4


def test_sampled_output_is_reproducible_with_a_seed(models):
    _, ours = models("custom_voice")
    voice = ours.voice(VoiceRequest(speaker="ryan"))
    def run(seed):
        sampling = SamplingParams.from_defaults(ours.config.generation, seed=seed)
        return ours.synthesize("A short sentence to sample.", voice, language="en", sampling=sampling,
                               max_frames=12).codes
    first, again, other = run(7), run(7), run(8)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_a_text_that_starts_with_a_line_break_gets_the_references_prompt(models):
    """The reference slices its template's first 3 ids as the role: a text that starts with a line break merges it
    into the role's own ("\\n\\n"), and the whole-text prompt now has that role too (a review's find: the plain
    role was used, so the prompt was not the reference's)."""
    reference, ours = models("custom_voice")
    text = "\nHello world, a line break first."
    ref_codes, _, _ = reference_generate(reference, "custom_voice", text, speaker="Vivian", instruct=None,
                                         ref_audio=None, ref_text=None, language="English",
                                         non_streaming_mode=True, frames=FRAMES)
    greedy = SamplingParams.from_defaults(ours.config.generation, greedy=True)
    result = ours.synthesize(text, ours.voice(VoiceRequest(speaker="Vivian")), language="English", layout="prefill",
                             sampling=greedy, max_frames=FRAMES)
    assert ours.tokenizer.target(text)[0] != ours.tokenizer.role_ids()
    np.testing.assert_array_equal(result.codes.numpy(), ref_codes)
