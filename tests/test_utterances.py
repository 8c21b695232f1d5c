"""Utterances and buffering (PROTOCOL.md "When buffered text speaks", "Utterances"): where a context's text splits
into utterances depends only on the text and its flush / mark / end points; a context's audio is its utterances'
audio, one after the other, however the text arrived."""
import asyncio
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.engine import Engine, EngineConfig
from engine.errors import EmptyText, VoxgateError
from engine.request import SynthesisRequest
from engine.sampling import SamplingParams
from engine.serving.async_engine import AsyncEngine
from engine.tts import TTSModel, VoiceRequest
from realtime.ws.speech_context import ContextAudio, ContextEnd, ContextMarker, ContextText, SpeechContext
from realtime.ws.utterances import WIDE_UNITS, UtterancePlanner, _clause_ends_at, _sentence_ends_at, units

LONG = "First sentence here. Second one is longer, with a clause! Is 3.14 a number? 最后一句。Tail"


def plan(pieces: list[str], max_chars: int) -> list[str]:
    planner = UtterancePlanner(max_utterance_chars=max_chars)
    for piece in pieces:
        planner.append(piece, now=0.0)
    planner.close()
    return [u.text for u in planner.utterances]


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_long_text_closes_at_the_first_sentence_end_past_the_limit_however_split():
    assert plan([LONG], max_chars=16) == ["First sentence here. ", "Second one is longer, with a clause! ",
                                          "Is 3.14 a number? ", "最后一句。Tail"]  # "Tail" never reaches a sentence end
    whole = plan([LONG], max_chars=12)
    # "Second one is longer," is past 18 units (1.5 x 12) at its comma: that clause end closes it; "最后一句" is 12
    assert whole == ["First sentence here. ", "Second one is longer, ", "with a clause! ", "Is 3.14 a number? ",
                     "最后一句。", "Tail"]
    rng = random.Random(0)
    for _ in range(50):
        assert plan(random_pieces(LONG, rng), max_chars=12) == whole
    assert plan([LONG], max_chars=1000) == [LONG]


WORDS = st.sampled_from(["word", "3,000", "3.14", "你好", "世界", "長い", "x" * 30]) | st.text(max_size=6)
GLUE = st.sampled_from([" ", ", ", ". ", "! ", "，", "。", "", "\n"])


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.tuples(WORDS, GLUE), max_size=120), max_chars=st.integers(4, 60),
       seed=st.integers(0, 2**32))
def test_no_utterance_grows_past_its_hard_limit_and_no_text_is_lost(parts, max_chars, seed):
    """Whatever the text (no sentence end for pages, no space, wide characters): every utterance the planner closes
    by itself is at most 2.5 x max_chars units long (plus two characters), the utterances are the text, and they
    split the same however the text came in pieces. The engine's KV slot holds ~2,000 frames: at 600 (the server's
    limit), 1,500 units of the slowest script are well inside it, where a page without a full stop was cut off."""
    text = "".join(word + glue for word, glue in parts)
    whole = plan([text], max_chars)
    assert "".join(whole) == text
    assert all(units(u) <= 2.5 * max_chars + 2 * WIDE_UNITS for u in whole)
    if len(text) > 1:
        assert plan(random_pieces(text, random.Random(seed)), max_chars) == whole


def walked_plan(text: str, max_chars: int) -> list[str]:
    """The module's rule, character by character (how the planner worked before it skipped what no rule can cut):
    an utterance closes after a character where, with `at` units before it, a sentence ends and at >= the limit, a
    clause ends and at >= 1.5 x, a space and at >= 2 x, or at >= 2.5 x."""
    utterances, current, at = [], "", 0
    for char in text:
        whole, i = current + char, len(current)
        if (at >= max_chars and _sentence_ends_at(whole, i) or at >= 1.5 * max_chars and _clause_ends_at(whole, i)
                or at >= 2 * max_chars and char.isspace() or at >= 2.5 * max_chars):
            utterances.append(whole)
            current, at = "", 0
        else:
            current, at = whole, at + units(char)
    return utterances + ([current] if current else [])


ASCII_WORDS = st.sampled_from(["word", "3,000", "3.14", "x" * 30, "a"]) | st.text("ab.,! \n", max_size=8)


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.tuples(WORDS | ASCII_WORDS, GLUE), max_size=120), max_chars=st.integers(4, 60),
       seed=st.integers(0, 2**32))
def test_utterances_split_where_the_rule_walked_character_by_character_splits(parts, max_chars, seed):
    text = "".join(word + glue for word, glue in parts)
    expected = walked_plan(text, max_chars)
    assert plan([text], max_chars) == expected
    if len(text) > 1:
        assert plan(random_pieces(text, random.Random(seed)), max_chars) == expected


def test_a_page_without_a_full_stop_is_spoken_in_bounded_utterances():
    page = " ".join(["word"] * 800)  # 3,999 characters, no sentence end: one utterance would outgrow its slot
    utterances = plan([page], max_chars=600)
    assert "".join(utterances) == page and len(utterances) == 4
    assert all(1200 <= units(u) <= 1210 for u in utterances[:-1])  # each closed at the first space past 1,200


@pytest.mark.parametrize("mode,text,due_at_once", [
    ("none", "Hello", True), ("auto", "Hello", False), ("auto", "Hello,", True), ("auto", "你好，", True),
    ("sentence", "Hello, there", False), ("sentence", "Hello there. And", True)])
def test_when_buffered_text_starts_speaking(mode, text, due_at_once):
    planner = UtterancePlanner(buffering=mode, max_buffer_delay_s=0.15)
    planner.append(text, now=10.0)
    assert (planner.start_due(10.0) is not None) == due_at_once
    if mode == "auto" and not due_at_once:
        assert planner.start_due(10.1) is None and planner.start_due(10.15) is not None
    if mode == "sentence" and not due_at_once:
        assert planner.start_due(99.0) is None  # no delay rule: only a sentence end, flush or end
        assert planner.close().started


@pytest.fixture(scope="module")
def tts(tiny_checkpoints) -> TTSModel:
    return TTSModel.load(tiny_checkpoints["custom_voice"])


def context_run(tts: TTSModel, script: list[tuple[str, str]], seed: int = 5, buffering: str = "auto",
                clean_text: bool = False):
    """Drive a context with (action, argument) steps, a few ms apart; returns its events."""
    async def main():
        runner = AsyncEngine(Engine(tts, EngineConfig(max_batch=2, capacity=256)))
        runner.start()
        try:
            template = SynthesisRequest("", tts.voice(VoiceRequest(speaker="ryan")), language="english",
                                        sampling=SamplingParams.from_defaults(tts.config.generation, seed=seed),
                                        max_frames=30, clean_text=clean_text)
            context = SpeechContext(runner, template, UtterancePlanner(buffering=buffering))
            for action, argument in script:
                getattr(context, action)(*([argument] if argument is not None else []))
                await asyncio.sleep(0.003)
            return [event async for event in context.events()]
        finally:
            await runner.stop()

    return asyncio.run(main())


def audio_of(events) -> np.ndarray:
    chunks = [e for e in events if isinstance(e, ContextAudio)]
    position = 0
    for chunk in chunks:
        assert chunk.start_sample == position  # one continuous timeline
        position += len(chunk.samples)
    return np.concatenate([c.samples for c in chunks])


def test_context_audio_is_its_utterances_in_order_with_markers_after_them(tts):
    first = "Good morning, everyone. "
    events = context_run(tts, [("append", "Good mor"), ("append", "ning, every"), ("append", "one. "),
                               ("flush", None), ("append", "See you "), ("mark", "m1"), ("append", "soon."),
                               ("end", None)])
    voice = tts.voice(VoiceRequest(speaker="ryan"))
    expected = [tts.synthesize(text, voice, language="english", layout="streaming", max_frames=30,
                               sampling=SamplingParams.from_defaults(tts.config.generation, seed=5 + k)).audio
                for k, text in enumerate([first, "See you ", "soon."])]
    np.testing.assert_allclose(audio_of(events), np.concatenate(expected), atol=1e-5, rtol=0)
    markers = [e for e in events if isinstance(e, ContextMarker)]
    assert [(m.kind, m.name, m.sample) for m in markers] == [
        ("flush", "1", len(expected[0])), ("mark", "m1", len(expected[0]) + len(expected[1]))]
    end = events[-1]
    assert isinstance(end, ContextEnd) and end.reason == "done" and end.samples == sum(map(len, expected))
    # each marker comes right after the last audio of the utterance it closed
    order = [type(e).__name__ for e in events]
    assert order.index("ContextMarker") > max(i for i, e in enumerate(events)
                                             if isinstance(e, ContextAudio) and e.start_sample < len(expected[0]))
    # each utterance's text is reported, whole and marked final once, before any of its audio
    texts = [e for e in events if isinstance(e, ContextText)]
    for k, text in enumerate([first, "See you ", "soon."]):
        mine = [e for e in texts if e.utterance == k]
        assert "".join(e.text for e in mine) == text and [e.final for e in mine].count(True) == 1
        first_audio = next(i for i, e in enumerate(events) if isinstance(e, ContextAudio)
                           and e.start_sample >= sum(map(len, expected[:k])))
        assert events.index(mine[0]) < first_audio


def test_same_text_split_differently_sounds_the_same(tts):
    text = "Split this text any way you like, it sounds the same."
    rng = random.Random(3)
    a = audio_of(context_run(tts, [("append", p) for p in random_pieces(text, rng)] + [("end", None)]))
    b = audio_of(context_run(tts, [("append", text), ("end", None)], buffering="none"))
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_a_context_without_speakable_text_ends_with_an_error(tts):
    events = context_run(tts, [("append", "   "), ("flush", None), ("end", None)])
    assert isinstance(events[0], ContextMarker) and events[0].kind == "flush"
    end = events[-1]
    assert isinstance(end, ContextEnd) and end.reason == "error" and end.samples == 0
    assert isinstance(end.error, EmptyText)


@pytest.mark.parametrize("empty", [" \U0001F389", " **", "   "])
def test_an_utterance_with_nothing_to_say_is_skipped_and_the_context_goes_on(tts, empty):
    """LLM output cleaned (an emoji, a markdown mark alone) can leave an utterance nothing to say: it is skipped with
    its flush reported, and the sentences after it are spoken; empty_text is only for a context with no audio."""
    script = [("append", "Great job."), ("flush", None), ("append", empty), ("flush", None),
              ("append", " Now the next step."), ("flush", None), ("end", None)]
    events = context_run(tts, script, clean_text=True)
    flushes = [e for e in events if isinstance(e, ContextMarker)]
    assert [f.name for f in flushes] == ["1", "2", "3"]
    end = events[-1]
    assert isinstance(end, ContextEnd) and end.reason == "done" and end.error is None
    # the third utterance spoke: audio after the second flush
    assert any(isinstance(e, ContextAudio) for e in events[events.index(flushes[1]):])


def test_a_failure_while_filing_the_audio_ends_the_context_with_an_error_and_frees_the_request(tts):
    """The utterance's events are filed as they come (`RequestHandle.listen`); a failure there (here the session's
    audio counter raising) ends the context with an error rather than hanging it, and its request leaves the
    engine."""
    async def main():
        runner = AsyncEngine(Engine(tts, EngineConfig(max_batch=2, capacity=256)))
        runner.start()
        try:
            template = SynthesisRequest("", tts.voice(VoiceRequest(speaker="ryan")), language="english",
                                        sampling=SamplingParams.from_defaults(tts.config.generation, seed=5),
                                        max_frames=30)
            context = SpeechContext(runner, template, UtterancePlanner(buffering="none"))
            context.on_audio = lambda samples: 1 / 0
            context.append("Hello there.")
            context.end()
            events = await asyncio.wait_for(_events_of(context), 60)
            await asyncio.sleep(0.1)  # the cancel reaches the step loop
            return events, runner.active
        finally:
            await runner.stop()

    events, active = asyncio.run(main())
    assert isinstance(events[-1], ContextEnd) and events[-1].reason == "error"
    assert isinstance(events[-1].error, VoxgateError)
    assert active == 0


async def _events_of(context: SpeechContext) -> list:
    return [event async for event in context.events()]
