"""Estimated word times: words are timed once complete, in order, never before the audio that was already made."""
from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realtime.ws.word_timing import WordTimeline, nominal_duration_s


def test_words_are_timed_once_complete_and_in_order():
    timeline = WordTimeline()
    assert [w.text for w in timeline.add(0, "Hello wor", final=False, audio_end_s=0.0)] == ["Hello"]  # "wor" goes on
    words = timeline.add(0, "ld, **how** are", final=False, audio_end_s=0.1)
    assert [w.text for w in words] == ["world,", "how"]  # markup stripped from the edges
    words = timeline.add(0, " you?", final=True, audio_end_s=0.2)
    assert [w.text for w in words] == ["are", "you?"]
    times = [(w.start_s, w.end_s) for w in timeline.words]
    assert times[0] == (0.0, pytest.approx(nominal_duration_s("Hello")))
    assert all(start < end for start, end in times)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(times, times[1:]))
    assert times[2][0] - times[1][1] == pytest.approx(0.15)  # the pause after a comma


def test_a_word_never_starts_before_the_audio_made_when_its_text_arrived():
    timeline = WordTimeline()
    timeline.add(0, "One ", final=False, audio_end_s=0.0)
    late = timeline.add(0, "two ", final=False, audio_end_s=3.0)  # the text came slowly: the audio ran ahead
    assert late[0].start_s == 3.0
    second = timeline.add(1, "Three.", final=True, audio_end_s=5.0)  # a new utterance starts where its audio does
    assert second[0].start_s == 5.0


def test_chinese_characters_are_words_with_their_punctuation_and_punctuation_alone_is_not():
    timeline = WordTimeline()
    words = timeline.add(0, "你好，世界 - ok", final=True, audio_end_s=0.0)
    assert [w.text for w in words] == ["你", "好，", "世", "界", "ok"]
    assert words[1].end_s - words[1].start_s == pytest.approx(0.22)
    assert words[2].start_s - words[1].end_s == pytest.approx(0.15)  # the full-width comma's pause
    assert words[1].start_s == words[0].end_s


def test_heard_text_is_the_text_up_to_the_last_word_half_played():
    timeline = WordTimeline()
    timeline.add(0, "Good morning, dear friends. ", final=True, audio_end_s=0.0)
    good, morning, dear = timeline.words[:3]
    assert timeline.heard_text(0.0) == ""
    assert timeline.heard_text((good.start_s + good.end_s) / 2) == "Good"
    assert timeline.heard_text(morning.end_s) == "Good morning,"
    assert timeline.heard_text(dear.end_s + 0.01) == "Good morning, dear"
    assert timeline.heard_text(100.0) == "Good morning, dear friends."


@settings(max_examples=200, deadline=None)
@given(text=st.text(st.sampled_from(list("你好世界，。！ab ,.?-*1\n")), max_size=30), data=st.data())
def test_words_and_their_times_are_the_same_however_the_text_arrives(text, data):
    """A word is timed once the character after it is in: a CJK character waits too, so that the punctuation after
    it joins it whether or not it came in the same append."""
    whole = WordTimeline().add(0, text, final=True, audio_end_s=0.0)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)))) if len(text) > 1 else set())
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    timeline, words = WordTimeline(), []
    for i, piece in enumerate(pieces):
        words += timeline.add(0, piece, final=i == len(pieces) - 1, audio_end_s=0.0)
    assert words == whole


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.text(st.sampled_from(list("ab ,.你")), min_size=1, max_size=20),
                          st.floats(0, 0.5)), min_size=1, max_size=5))
def test_words_never_overlap_across_utterances(utterances):
    """Each utterance's text reaches the engine when the audio made so far (which only grows) may be shorter than
    the previous words' estimate: a word still starts after the one before it ends."""
    timeline, audio_end_s, words = WordTimeline(), 0.0, []
    for index, (text, made_s) in enumerate(utterances):
        audio_end_s += made_s
        words += timeline.add(index, text, final=True, audio_end_s=audio_end_s)
    assert all(a.end_s <= b.start_s for a, b in pairwise(words)), [(w.start_s, w.end_s) for w in words]


def test_words_are_the_words_the_model_is_given():
    """The engine's clean-up decides what is said: list markers at a line's start and emoji say nothing, a URL is
    its host name (and lasts as long as that), a link its text. A hostile try found the raw forms timed: the whole
    URL for 2.6 s, the markers as words."""
    text = "1. First item 😀\n2) Second https://www.example.com/a/very/long/path?query=1&x=2 done. [see docs](https://x.io/y)"
    words = WordTimeline().add(0, text, final=True, audio_end_s=0.0)
    assert [w.text for w in words] == ["First", "item", "Second", "example.com", "done.", "see", "docs"]
    host = words[3]
    assert host.end_s - host.start_s == pytest.approx(nominal_duration_s("example.com"))
    assert [w.text for w in WordTimeline().add(0, "Call 1. then 2) now", final=True, audio_end_s=0.0)] == [
        "Call", "1.", "then", "2", "now"]  # markers only where they start a line (parentheses at edges go)
    timeline = WordTimeline()  # a number at a line's start waits for what follows it there, as the clean-up does
    assert [w.text for w in timeline.add(0, "Steps:\n3. ", final=False, audio_end_s=0.0)] == ["Steps:"]
    assert [w.text for w in timeline.add(0, "Install it", final=True, audio_end_s=0.0)] == ["Install", "it"]
    assert [w.text for w in WordTimeline().add(0, "Dial\n911. \nnow", final=True, audio_end_s=0.0)] == [
        "Dial", "911.", "now"]


def test_each_utterance_is_cleaned_from_a_lines_start_as_the_engine_cleans_it_and_raw_text_stays_raw():
    """The engine cleans each utterance (one request) from a line's start: a marker that opens an utterance mid-line
    is dropped there, so it is not timed. With the gateway's clean-up off, the words are the raw tokens."""
    timeline = WordTimeline()
    first = timeline.add(0, "Intro. ", final=True, audio_end_s=0.0)
    second = timeline.add(1, "1. item one", final=True, audio_end_s=1.0)
    assert [w.text for w in first + second] == ["Intro.", "item", "one"]
    raw = WordTimeline(clean_text=False).add(0, "1. See https://www.example.com/x now", final=True, audio_end_s=0.0)
    assert [w.text for w in raw] == ["1.", "See", "https://www.example.com/x", "now"]
