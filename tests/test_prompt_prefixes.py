"""Prompt prefixes kept per voice: every prompt equals the one a fresh builder makes, whichever voices, instructions
and languages came before it, and a cloned voice never takes another's prefix."""
import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.prompt import PromptBuilder
from engine.tts import TTSModel, VoiceRequest


@pytest.fixture(scope="module")
def models(tiny_checkpoints) -> dict[str, TTSModel]:
    return {variant: TTSModel.load(tiny_checkpoints[variant]) for variant in ("custom_voice", "base")}


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
@given(requests=st.lists(st.tuples(st.sampled_from(["vivian", "ryan"]), st.sampled_from([None, "Calm.", "Loud!"]),
                                   st.sampled_from(["auto", "english", "chinese"]),
                                   st.lists(st.integers(1000, 5000), min_size=1, max_size=6),
                                   st.sampled_from(["streaming", "prefill"])), min_size=1, max_size=8))
def test_a_kept_prefix_gives_the_fresh_prompt_for_any_order_of_voices(models, requests):
    tts = models["custom_voice"]
    for speaker, instruct, language, ids, layout in requests:
        voice = tts.voice(VoiceRequest(speaker=speaker, instruct=instruct))
        assert_same(tts.prompt_from_ids(ids, voice, language, layout), fresh(tts, ids, voice, language, layout))


def test_cloned_voices_keep_their_own_prefix_even_when_an_id_is_reused(models):
    tts = models["base"]
    size = tts.config.speaker_encoder.enc_dim
    ids = [1200, 1300, 1400]
    for seed in range(6):  # each x-vector dropped after use: a new one may get the old one's address
        voice = tts.voice_from_parts(torch.randn(size, generator=torch.Generator().manual_seed(seed)))
        assert_same(tts.prompt_from_ids(ids, voice, "english", "streaming"),
                    fresh(tts, ids, voice, "english", "streaming"))
        del voice
        gc.collect()
