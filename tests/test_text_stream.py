"""Text in pieces: the incremental tokenizer gives exactly the ids of the whole text, however it was split, and
the text feed holds, ends and pads as the streaming layout says."""
import random
import re
import time
import unicodedata

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.text.incremental import IncrementalTokenizer, TextFeed
from engine.text.tokenizer import ROLE_PREFIX, TextTokenizer, load_tokenizer

TEXTS = [
    "Hello there, how are you today?",
    "It's 3.14 -- isn't it?  Yes!!\n\nNew paragraph.",
    "你好，世界！我们 123 走吧。日本語のテキストも。",
    "cafe\u0301 naïve e\u0301\u0302 한국어 \u1112\u1161\u11ab and Ωmega",
    "  leading and trailing spaces   ",
    "emoji 😀👍🏽 and a URL https://example.com/a?b=1&c=2",
    "don't 'quote' we'll they'RE I'M",
    "\n\nstarts with newlines",
    "tabs\tand\r\nCRLF line ends\r\n",
    "数字12345和English混合text, 1,000,000.50 dollars",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints) -> TextTokenizer:
    return TextTokenizer(load_tokenizer(tiny_checkpoints["custom_voice"]))


def split(text: str, rng: random.Random, how: str) -> list[str]:
    if how == "whole":
        return [text]
    if how == "chars":
        return list(text)
    if how == "words":
        return [w for w in text.replace(" ", " \0").split("\0") if w]
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def incremental(tokenizer: TextTokenizer, pieces: list[str]) -> list[int]:
    stream = IncrementalTokenizer(tokenizer)
    ids = [i for piece in pieces for i in stream.append(piece)]
    return ids + stream.finish()


@pytest.mark.parametrize("how", ["whole", "chars", "words", "random"])
def test_incremental_tokenization_equals_the_whole_text(tokenizer, how):
    rng = random.Random(how)
    for text in TEXTS:
        for _ in range(1 if how != "random" else 25):
            assert incremental(tokenizer, split(text, rng, how)) == tokenizer.target(text)[1], text


@pytest.mark.parametrize("text", TEXTS)
def test_text_without_control_strings_gets_the_reference_templates_ids(tokenizer, text):
    """The reference encodes each filled template whole and slices it; text that spells no control token gets those
    ids from its pieces between the markers."""
    whole = tokenizer.encode(f"{ROLE_PREFIX}{text}<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.target(text) == (whole[:3], whole[3:-5])
    assert tokenizer.reference_text(text) == tokenizer.encode(f"<|im_start|>assistant\n{text}<|im_end|>\n")[3:-2]
    assert tokenizer.instruction(text) == tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n")


def controls(tokenizer: TextTokenizer) -> dict[int, str]:
    """The checkpoint's control tokens: id -> the string that spells it."""
    return {i: token.content for i, token in tokenizer.tokenizer.get_added_tokens_decoder().items()}


@settings(max_examples=80, deadline=None)
@given(data=st.data())
@example(data=None)
def test_control_token_strings_in_text_are_read_as_text(tokenizer, data):
    """A hostile try's find: text spelling a control token (`<think>`, `<|im_end|>`, `<tts_text_eod>`) lost
    characters or gained tokens when streamed (a cut fell inside the control's string), and whole it became the
    control itself (`tts_eos` in the middle of the text). Now every piece of it is text: however it is split, the
    ids are the whole text's, none is a control, and they decode to the text."""
    spelled = sorted(controls(tokenizer).values())
    if data is None:  # the report's cases, split inside the control's string
        text, cuts = "Hello <tts_te" + "xt_eod> rest. <think>I should</think>Hi", [13, 27, 35]
    else:
        words = st.sampled_from(spelled) | st.sampled_from(["Hello", " there", " ", ".", "<", "|>", "_end", "\n", "a"])
        # it starts with a word: leading newlines join the role's own (the reference's slicing, TEXTS has them)
        text = "I" + "".join(data.draw(st.lists(words, max_size=8)))
        cuts = sorted(data.draw(st.sets(st.integers(1, len(text) - 1), max_size=6))) if len(text) > 1 else []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    ids = incremental(tokenizer, pieces)
    assert ids == tokenizer.target(text)[1]
    assert not set(ids) & controls(tokenizer).keys()
    assert tokenizer.tokenizer.decode(ids) == text
    assert tokenizer.tokenizer.decode(tokenizer.reference_text(text)) == text
    block = tokenizer.instruction(text)
    assert not set(block[1:-2]) & controls(tokenizer).keys()
    assert tokenizer.tokenizer.decode(block[1:-2]) == f"user\n{text}"


def test_a_feed_ends_once_whatever_its_text_spells(tokenizer):
    """`tts_eos` comes where the input ended, never from text that spells it."""
    eos = tokenizer.tokenizer.token_to_id("<tts_text_eod>")
    feed = TextFeed(tokenizer, eos_id=eos, pad_id=-2, cleanup=True)
    for piece in ["Hello <tts_te", "xt_eod> and the rest is heard."]:
        feed.append(piece)
    feed.end()
    assert eos not in feed.ids and tokenizer.tokenizer.decode(feed.ids) == "Hello <tts_text_eod> and the rest is heard."
    assert [feed.text_id(step) for step in range(len(feed.ids), len(feed.ids) + 2)] == [eos, -2]


DECOMPOSED = ["cafe\u0301", "'s", " Vie\u0302\u0323t", "-Nam", " Mu\u0308ller", "\u0301", "e\u0301.", " ", "x",
              "\u1112\u1161\u11ab", "!\n"]  # NFD, as macOS and some IMEs write it: the tokenizer reads it as NFC


@settings(max_examples=80, deadline=None)
@given(data=st.data())
@example(data=None)
def test_decomposed_text_in_pieces_gets_the_whole_texts_ids(tokenizer, data):
    """A review's find: cut where the text's own pre-tokens end, decomposed text was cut inside a pre-token of its
    normalised form, and the word across the cut lost characters ("The cafe\u0301's menu" read "The cafés menu",
    "Vie\u0302\u0323t-Nam" read "Vit-Nam"). However it is split, the ids are the whole text's and decode to it."""
    if data is None:
        text, cuts = "The cafe\u0301's menu. Vie\u0302\u0323t-Nam rocks.", [10, 15, 31, 36]
    else:
        text = "I" + "".join(data.draw(st.lists(st.sampled_from(DECOMPOSED), min_size=1, max_size=10)))
        cuts = sorted(data.draw(st.sets(st.integers(1, len(text) - 1), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    ids = incremental(tokenizer, pieces)
    assert ids == tokenizer.target(text)[1]
    assert tokenizer.tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


@settings(max_examples=60, deadline=None)
@given(words=st.lists(st.sampled_from(["Okay", "sure", "thing", "it's", "3.14", "你好", "naïve", "we'll", "--", "!!",
                                       "café", "x", "12", "Ωmega", "end.\n", "so!\n\n", "ok ...\n", "why?\r\n",
                                       "cafe\u0301", "Jose\u0301's", "Vie\u0302\u0323t"]),
                      min_size=1, max_size=8),
       settle_after=st.sets(st.integers(0, 7)), trailing=st.booleans())
def test_settled_words_give_the_whole_texts_ids(tokenizer, words, settle_after, trailing):
    """The text pauses (`settle`) after any word, with or without a space appended before the pause: the ids
    released then are final, and all of them are the whole text's, because the next piece starts a word."""
    stream = IncrementalTokenizer(tokenizer)
    ids = []
    for index, word in enumerate(words):
        ids += stream.append((" " if index else "") + word + (" " if trailing and index in settle_after else ""))
        if index in settle_after:
            ids += stream.settle()
    whole = "".join((" " if i else "") + w + (" " if trailing and i in settle_after else "")
                    for i, w in enumerate(words))
    assert ids + stream.finish() == tokenizer.target(whole)[1]


def test_a_pause_reads_the_held_words_at_once(tokenizer):
    """Without a pause the last two pre-tokens wait for more text: "Okay sure thing" gives "Okay" alone; settled, it
    gives all three words, and its trailing space stays to join the next word."""
    stream = IncrementalTokenizer(tokenizer)
    held = stream.append("Okay sure thing ")
    settled = stream.settle()
    assert tokenizer.tokenizer.decode(held) == "Okay sure" and tokenizer.tokenizer.decode(settled) == " thing"
    assert stream.settle() == [] and stream.append("now.") == [] and stream.finish()


@pytest.mark.parametrize("cleanup", [False, True])
def test_a_settled_feed_reads_every_word_and_its_punctuation(tokenizer, cleanup):
    """A review's finds: the cut fell inside "thing.\n" (one pre-token) and dropped the period; and with clean-up on
    (the default) the clean-up still held the last word. Settled, the feed has every word and mark so far."""
    feed = TextFeed(tokenizer, eos_id=-1, pad_id=-2, cleanup=cleanup)
    feed.append("Okay sure thing.\n")
    feed.settle()
    assert tokenizer.tokenizer.decode(feed.ids) == "Okay sure thing.\n"
    feed.append("Yes")
    feed.settle()
    assert tokenizer.tokenizer.decode(feed.ids) == "Okay sure thing.\nYes"


def test_ids_become_final_while_the_text_arrives(tokenizer):
    """A word-by-word stream releases each word's ids one word later (its last two pre-tokens are held back)."""
    stream = IncrementalTokenizer(tokenizer)
    released = [len(stream.append(word + " ")) for word in "one two three four five six seven".split()]
    assert released == [0, 1, 1, 1, 1, 1, 1]


def test_feed_holds_then_ends_with_eos_and_pads(tokenizer):
    feed = TextFeed(tokenizer, eos_id=-1, pad_id=-2)
    feed.append("Hello there, my friend")
    feed.consumed = 1  # the prefill took the first id
    assert feed.text_id(0) == feed.ids[1] and feed.text_id(len(feed.ids)) is None  # not arrived: hold
    feed.end()
    whole = tokenizer.target("Hello there, my friend")[1]
    assert feed.ids == whole
    track = [feed.text_id(step) for step in range(len(whole) + 2)]
    assert track == [*whole[1:], -1, -2, -2]
    with pytest.raises(ValueError, match="after the end"):
        feed.append("more")


LLM_OUTPUT = ("# Plan for today\n\n- **First**, read [the docs](https://docs.example.com/start) 😀\n"
              "2. Then visit https://www.example.com/path?q=1 and _relax_.\n> A `quoted` line.\n"
              "```python\nprint(snake_case, 2*3)\n```\nDone 👍🏽 — really ✨done✨.")


def test_cleanup_rules():
    from engine.text.cleanup import clean_text

    assert clean_text(LLM_OUTPUT) == (
        "Plan for today\n\nFirst, read the docs \nThen visit example.com and relax.\nA quoted line.\n\n"
        "print(snake_case, 2*3)\n\nDone — really done.")
    assert clean_text("Plain text, 3.14 and C++ stay; so does #hashtag - here.") == \
        "Plain text, 3.14 and C++ stay; so does #hashtag - here."


@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.sampled_from(["42.", "1)", "7", ".", " ", "\t", "\u00a0", "\n", "\r\n", "Dial", "- ", "# "]),
                     max_size=12).map("".join), cut=st.integers(0, 40), settle=st.booleans())
@example(text="42. 42.", cut=1, settle=True)  # a pause inside the marker's digits ("4", then "2. 42.")
def test_a_number_ends_a_line_as_itself_and_marks_one_only_before_more(text, cut, settle):
    """A hostile try: "42." alone was refused as empty text, and "Dial\n911." lost its number, both read as list
    markers. A number at a line's start is a marker only where more text follows it on its line; otherwise it is
    read. Cut anywhere, and with a pause at the cut (settle), the text cleans as the whole does: a number the pause
    cannot tell waits."""
    from engine.text.cleanup import StreamingCleanup, clean_text

    cleanup = StreamingCleanup()
    cleaned = clean_text(text)
    first = cleanup.append(text[:cut]) + (cleanup.settle() if settle else "")
    assert first + cleanup.append(text[cut:]) + cleanup.finish() == cleaned
    assert clean_text("42.") == "42." and clean_text("42. ") == "42. " and clean_text("7)\n") == "7)\n"
    assert clean_text("Dial\n911. \nnow") == "Dial\n911. \nnow"
    assert clean_text("1. Go there\n2.\tthen here") == "Go there\nthen here"


INVISIBLE = "\u00ad\u200b\u200c\u200e\u200f\u202a\u202e\u2060\u2064\u2066\u2069\ufeff"


@given(text=st.text(st.sampled_from(list(INVISIBLE + "ab *#\n.\u200d") + ["\U0001F600"]), max_size=30),
       cut=st.integers(0, 30))
@example(text="*****\n ", cut=6)  # a dropped word, its line break, then spaces in the next piece
def test_invisible_characters_go_and_pieces_clean_as_the_whole(text, cut):
    """Zero-width and direction characters, a soft hyphen, the BOM: none is left, and text cut anywhere is cleaned
    as the whole is."""
    from engine.text.cleanup import StreamingCleanup, clean_text

    cleaned = clean_text(text)
    assert not set(cleaned) & set(INVISIBLE)
    cleanup = StreamingCleanup()
    assert cleanup.append(text[:cut]) + cleanup.append(text[cut:]) + cleanup.finish() == cleaned
    assert clean_text("Zero\u200bwidth and soft\u00adhyphen \ufeff\u200f words.") == "Zerowidth and softhyphen words."


# the rule for emphasis and code marks as first written: a regex whose cost is cubic in a word's length
EDGE_MARKS_RULE = re.compile(r"^[*_~`]+|[*_~`]+(?=[^\w]*$)")


@settings(max_examples=500, deadline=None)
@given(word=st.text(st.sampled_from(list("*_~`ab1é,.-—") + ["\u0301"]), max_size=14))
def test_edge_marks_go_as_the_rule_says_in_linear_time(word):
    """Marks at a word's start, and every run of them with no word character after it, go; the rest stays. The
    same as the rule's regex on every short word, and a word of thousands of marks in a blink (the regex took
    seconds: the engine's step, and every stream with it, waited)."""
    from engine.text.cleanup import clean_word

    assert clean_word(word, line_start=False) == EDGE_MARKS_RULE.sub("", word)
    hostile = "x" + "*" * 1400 + "-" * 1400 + "a"
    started = time.perf_counter()
    assert clean_word(hostile, line_start=False) == hostile
    assert time.perf_counter() - started < 0.5


@pytest.mark.parametrize("unit", ["](", "[x](", "](a", "](" + "a" * 50, "[a](b(c)"])
def test_link_targets_go_in_linear_time(unit):
    """A link's target goes wherever it is in a word, and a word of 40,000 characters made of link openings is
    cleaned in a blink (the target's pattern ran on over every later `](`: quadratic, seconds of the step)."""
    from engine.text.cleanup import clean_text

    assert clean_text("[the docs](https://example.com/a_b?c=1), then x[y](z)w.") == "the docs, then xyw."
    hostile = unit * (40_000 // len(unit))
    started = time.perf_counter()
    clean_text(hostile)
    assert time.perf_counter() - started < 0.5


@pytest.mark.parametrize("how", ["chars", "random"])
def test_cleaned_feed_equals_cleaning_the_whole_text(tokenizer, how):
    from engine.text.cleanup import clean_text

    rng = random.Random(how)
    for _ in range(10):
        feed = TextFeed(tokenizer, eos_id=-1, pad_id=-2, cleanup=True)
        for piece in split(LLM_OUTPUT, rng, how):
            feed.append(piece)
        feed.end()
        assert feed.text == clean_text(LLM_OUTPUT)
        assert feed.ids == tokenizer.target(clean_text(LLM_OUTPUT))[1]
