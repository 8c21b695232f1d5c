"""Prompt prefixes kept per voice, and the text vectors of streaming prompts' first tokens: every prompt equals the one
a fresh builder makes, whichever voices, instructions, languages and texts came before it, however few are kept and
however long the prefixes are, and cloned voices (never kept) get their own. A prompt's trailing text is built only
when read, from the ids it was built with."""
from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.prompt import PromptBuilder
from engine.tts import TTSModel, VoiceRequest

LONG = "Speak slowly and very calmly, like a late-night radio host reading the shipping forecast."


@pytest.fixture(scope="module")
def models(tiny_checkpoints) -> dict[str, TTSModel]:
    return {variant: TTSModel.load(tiny_checkpoints[variant]) for variant in ("custom_voice", "voice_design", "base")}


def fresh(tts: TTSModel, *args):
    """The prompt a builder that has kept nothing makes."""
    kept = tts.prompts
    tts.prompts = PromptBuilder(tts.config, tts.talker)
    try:
        return tts.prompt_from_ids(*args)
    finally:
        tts.prompts = kept


def assert_same(a, b) -> None:
    assert torch.equal(a.prefill, b.prefill) and torch.equal(a.trailing_text, b.trailing_text)
    assert torch.equal(a.pad, b.pad) and a.trailing_ids == b.trailing_ids


@settings(max_examples=30, deadline=None)
@given(requests=st.lists(st.tuples(st.sampled_from(["custom_voice", "voice_design"]),
                                   st.sampled_from(["vivian", "ryan"]), st.sampled_from([None, "Calm.", "Loud!", LONG]),
                                   st.sampled_from(["auto", "english", "chinese"]),
                                   st.lists(st.integers(1000, 1004) | st.integers(1000, 5000), min_size=1, max_size=6),
                                   st.sampled_from(["streaming", "prefill"])), min_size=1, max_size=10),
       kept=st.integers(1, 4))
def test_a_kept_prefix_gives_the_fresh_prompt_for_any_order_of_voices(models, requests, kept):
    for tts in models.values():
        tts.prompts = PromptBuilder(tts.config, tts.talker)  # each example starts with nothing kept
    with (patch("engine.prompt.PREFIXES_KEPT", kept), patch("engine.prompt.PREFIX_ROWS_KEPT", 16),
          patch("engine.prompt.FIRST_TOKENS_KEPT", kept)):
        for variant, speaker, instruct, language, ids, layout in requests:
            tts = models[variant]
            voice = tts.voice(VoiceRequest(speaker=speaker, instruct=instruct) if variant == "custom_voice"
                              else VoiceRequest(instruct=instruct or "A warm voice."))
            assert_same(tts.prompt_from_ids(ids, voice, language, layout), fresh(tts, ids, voice, language, layout))
            assert len(tts.prompts._prefixes) <= kept
            assert all(sum(p.shape[0] for p in prefix) <= 16 for prefix, _ in tts.prompts._prefixes.values())
            assert len(tts.prompts._first_tokens) <= kept


@pytest.mark.parametrize("variant", ["custom_voice", "base"])
@pytest.mark.parametrize("layout", ["streaming", "prefill"])
def test_trailing_text_is_built_when_read_from_the_ids_given(models, variant, layout):
    tts = models[variant]
    voice = (tts.voice(VoiceRequest(speaker="ryan")) if variant == "custom_voice" else
             tts.voice_from_parts(torch.randn(tts.config.speaker_encoder.enc_dim), torch.randint(0, 100, (3, 16)),
                                  "Hello there."))
    ids = [1200, 1300, 1400, 1500, 1600]
    expected = fresh(tts, list(ids), voice, "english", layout)
    prompt = tts.prompt_from_ids(ids, voice, "english", layout)
    assert "trailing_text" not in vars(prompt)  # nothing built for it yet: the engine never reads it
    ids.append(1700)  # the caller's list grows (a streaming request's text feed)
    assert_same(prompt, expected)


def test_cloned_voices_get_their_own_prefix(models):
    tts = models["base"]
    size = tts.config.speaker_encoder.enc_dim
    ids = [1200, 1300, 1400]
    prompts = []
    for seed in range(4):
        voice = tts.voice_from_parts(torch.randn(size, generator=torch.Generator().manual_seed(seed)))
        prompts.append(tts.prompt_from_ids(ids, voice, "english", "streaming"))
        assert_same(prompts[-1], fresh(tts, ids, voice, "english", "streaming"))
    assert not any(torch.equal(a.prefill, b.prefill) for a, b in zip(prompts, prompts[1:]))
