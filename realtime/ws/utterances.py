"""A context's text as utterances, and when buffered text starts speaking (PROTOCOL.md "When buffered text speaks"
and "Utterances").

An utterance is one engine request with streaming text: the model is told its text is complete (`tts_eos`) only
when the utterance closes. A flush, a mark and the end of the context close it; so does the planner itself once it is
long, which bounds the speaking-rate drift of long inputs and keeps every utterance well inside the engine's KV slot
(an utterance that filled it would lose its end): at the first sentence end past `max_utterance_chars`, failing that
at the first clause end past 1.5 times that, a space past twice that, and anywhere at 2.5 times. Lengths are counted
in `units`: a wide (CJK) character is WIDE_UNITS, nearer the speech it takes than one Latin letter. Where utterances
split depends only on the text and the client's flush / mark / end, never on timing or on how the text was cut into
appends, so a seeded context sounds the same however its text arrived (one exception, outside this planner: text
that stops for seconds closes the utterance being spoken, `speech_context.TEXT_PAUSE_S`).

Buffering decides only *when* an utterance's text starts going to the engine: `none` at once, `sentence` at a
sentence end, `auto` at a clause boundary or `max_buffer_delay_s` after its first text, whichever comes first;
closing an utterance always starts it.
"""
from __future__ import annotations

import unicodedata
from dataclasses import dataclass

from engine.text.cleanup import speakable

CLAUSE_ENDS = frozenset(".,;:!?\n。，；：！？、")
SENTENCE_ENDS = frozenset(".!?\n。！？")
FULL_WIDTH_SENTENCE_ENDS = frozenset("。！？\n")  # end a sentence without a following space
FULL_WIDTH_CLAUSE_ENDS = frozenset("。，；：！？、\n")  # end a clause without a following space
BUFFERING = ("auto", "none", "sentence")
# A wide character's length in units: Mandarin is read at ~4-5 characters a second, English at ~15 letters, so a
# character of 3 units keeps the limits in the same seconds of speech (the engine's slot holds ~160 s).
WIDE_UNITS = 3


@dataclass
class Utterance:
    index: int
    text: str = ""
    units: int = 0  # the text's length in units (`units`)
    closed: bool = False
    started: bool = False  # its text goes to the engine from now on
    first_text_at: float | None = None
    started_at: float | None = None  # when `start_due` started it (a clause boundary or the buffering delay)


class UtterancePlanner:
    def __init__(self, buffering: str = "auto", max_buffer_delay_s: float = 0.15,
                 max_utterance_chars: int = 600) -> None:
        if buffering not in BUFFERING:
            raise ValueError(f"text buffering must be one of {', '.join(BUFFERING)}")
        self.buffering = buffering
        self.max_buffer_delay_s = max_buffer_delay_s
        self.max_utterance_chars = max_utterance_chars
        self.utterances: list[Utterance] = []

    @property
    def open(self) -> Utterance | None:
        return self.utterances[-1] if self.utterances and not self.utterances[-1].closed else None

    def append(self, text: str, now: float) -> None:
        """Text for the context: into the open utterance (a new one if none is open), closed at a sentence end once
        it is long."""
        while text:
            utterance = self.open or self._new()
            if utterance.first_text_at is None:
                utterance.first_text_at = now
            cut = self._cut(utterance, text)
            if cut is None:
                utterance.text += text
                utterance.units += units(text)
                return
            utterance.text += text[:cut]
            utterance.units += units(text[:cut])
            text = text[cut:]
            self.close()

    def close(self) -> Utterance | None:
        """Flush, mark or end: the open utterance is complete and starts speaking (None if none was open)."""
        utterance = self.open
        if utterance is not None:
            utterance.closed = utterance.started = True
        return utterance

    def start_due(self, now: float) -> Utterance | None:
        """The open utterance, if its buffered text should start speaking now (it stays started)."""
        utterance = self.open
        if utterance is None or utterance.started or not speakable(utterance.text):
            return None
        if (self.buffering == "none" or (self.buffering == "sentence" and _has_sentence_end(utterance.text)) or
                (self.buffering == "auto" and (any(c in CLAUSE_ENDS for c in utterance.text) or
                                               now - utterance.first_text_at >= self.max_buffer_delay_s))):
            utterance.started = True
            by_delay = self.buffering == "auto" and not any(c in CLAUSE_ENDS for c in utterance.text)
            utterance.started_at = utterance.first_text_at + self.max_buffer_delay_s if by_delay else now
            return utterance
        return None

    def _new(self) -> Utterance:
        self.utterances.append(Utterance(len(self.utterances)))
        return self.utterances[-1]

    def _cut(self, utterance: Utterance, text: str) -> int | None:
        """Where `text` should be cut to close the utterance, it being long (the module's docstring says where);
        None if it is not due yet."""
        limit, at = self.max_utterance_chars, utterance.units  # at: units before whole[i]
        ascii_only = text.isascii()  # a unit a character
        if at + (1 if ascii_only else WIDE_UNITS) * len(text) < limit:
            return None  # no rule cuts before the limit: most appends end here, unscanned
        skip = max(0, limit - at) if ascii_only else 0  # characters before the limit, where nothing cuts
        whole, start = utterance.text + text, len(utterance.text)
        at += skip
        for i in range(start + skip, len(whole)):
            char = whole[i]
            if at >= limit and _sentence_ends_at(whole, i) or at >= 1.5 * limit and _clause_ends_at(whole, i) or (
                    at >= 2 * limit and char.isspace()) or at >= 2.5 * limit:
                return i + 1 - start
            at += units(char)
        return None


def units(text: str) -> int:
    """The length of `text` as the utterance limits count it: WIDE_UNITS for a wide (CJK) character, else 1."""
    if text.isascii():
        return len(text)
    return sum(WIDE_UNITS if unicodedata.east_asian_width(char) in "WF" else 1 for char in text)


def _sentence_ends_at(text: str, i: int) -> bool:
    """The sentence ends at text[i]: a full-width end or newline, or whitespace after `.`, `!`, `?`."""
    if text[i] in FULL_WIDTH_SENTENCE_ENDS:
        return True
    return text[i].isspace() and i > 0 and text[i - 1] in SENTENCE_ENDS


def _clause_ends_at(text: str, i: int) -> bool:
    """A clause ends at text[i]: a full-width clause end, or whitespace after a clause end (so "3,000" goes on)."""
    if text[i] in FULL_WIDTH_CLAUSE_ENDS:
        return True
    return text[i].isspace() and i > 0 and text[i - 1] in CLAUSE_ENDS


def _has_sentence_end(text: str) -> bool:
    return any(_sentence_ends_at(text, i) for i in range(len(text))) or text.rstrip()[-1:] in SENTENCE_ENDS
