"""Estimated word times of a context: the `timestamps` events (`timestamps: "word"`) and the `heard_text` of a
cancel with `played_ms`.

The model gives no alignment, so times are estimates (`estimated: true`): each word is the word as the model is
given it (the engine's clean-up: a list marker or an emoji says nothing, a URL is its host name, a link its text),
lasts a nominal time for that word's length and starts no earlier than the audio already made when its text reached
the engine, nor before the words before it have ended (an utterance's estimate may run past its audio: the next
one's words follow them). Words are timed as soon as their text goes to the engine, so their event always goes out
before the audio they describe.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from engine.text.cleanup import StreamingCleanup

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
# a CJK character is a word of its own, with the punctuation right after it ("好。"); elsewhere a word is a run of
# non-space characters: either way a word keeps the punctuation after it
_TOKEN = re.compile(f"[{_CJK}][^\\w\\s{_CJK}]*|[^\\s{_CJK}]+")
_SPOKEN = re.compile(r"\w")
_LINE_SPACES = re.compile(r"[^\S\n]*")
_MARKUP = "*_#`~>|[](){}\"'"  # stripped from a word's edges (not read out)

CJK_CHAR_S = 0.22
CHAR_S = 0.065
WORD_S = 0.04
PAUSES_S = {",": 0.15, ";": 0.15, ":": 0.15, ".": 0.3, "!": 0.3, "?": 0.3,
            "，": 0.15, "；": 0.15, "：": 0.15, "、": 0.1, "。": 0.3, "！": 0.3, "？": 0.3}


@dataclass(frozen=True)
class Word:
    text: str
    start_s: float  # from the start of the context's audio
    end_s: float
    text_end: int  # offset just past the word in the context's text


def nominal_duration_s(word: str) -> float:
    if _is_cjk(word):
        return CJK_CHAR_S
    return WORD_S + CHAR_S * sum(ch.isalnum() for ch in word)


class WordTimeline:
    def __init__(self, clean_text: bool = True) -> None:
        """`clean_text`: the engine cleans the text it is given (GatewayOptions.clean_text), so words are cleaned."""
        self.clean_text = clean_text
        self.text = ""  # the context's text that went to the engine
        self.words: list[Word] = []
        self._untimed_from = 0  # offset of the first character not yet split into words
        self._utterance = -1
        self._cursor_s = 0.0  # where the next word of the current utterance may start
        self._spoken = StreamingCleanup()  # each word as the engine's clean-up gives it to the model

    def add(self, utterance: int, text: str, final: bool, audio_end_s: float) -> list[Word]:
        """Text that went to the engine for `utterance` while the context's audio reached `audio_end_s`; returns the
        words it completed (a word at the end of the text waits for the next character unless `final`)."""
        if utterance != self._utterance:  # where its audio starts, but never inside the words already sent
            self._utterance = utterance
            self._cursor_s = max(self._cursor_s, audio_end_s)
            self._spoken = StreamingCleanup()  # each utterance is an engine request, cleaned from a line's start
        self.text += text
        timed = []
        for token in _TOKEN.finditer(self.text, self._untimed_from):
            if token.end() == len(self.text) and not final:  # the next character may still belong to it
                break
            if "\n" in self.text[self._untimed_from:token.start()]:
                self._spoken.line_break()
            more_on_line = self._more_on_line(token.end())
            if self.clean_text and more_on_line is None and not final and self._spoken.waits(token.group()):
                break  # a number at a line's start: a list marker only if more text comes on its line
            self._untimed_from = token.end()
            word = (self._spoken.word(token.group(), bool(more_on_line)) if self.clean_text
                    else token.group()).strip(_MARKUP)
            if _SPOKEN.search(word):
                start = max(self._cursor_s, audio_end_s)
                end = start + nominal_duration_s(word)
                timed.append(Word(word, start, end, token.end()))
                self._cursor_s = end
            if word:  # punctuation, attached or standing alone ("你好，世界"), pauses
                self._cursor_s += PAUSES_S.get(word[-1], 0.0)
        self.words += timed
        return timed

    def _more_on_line(self, end: int) -> bool | None:
        """Whether more text follows the token ending at `end` on its line, as the clean-up tells it of a
        whitespace-separated word; None while only spaces have come after it."""
        if end < len(self.text) and not self.text[end].isspace():
            return False  # glued to what follows (CJK): the clean-up's word is longer than this token
        gap = _LINE_SPACES.match(self.text, end).end()
        return None if gap == len(self.text) else self.text[gap] != "\n"

    def heard_text(self, played_s: float) -> str:
        """The text up to the last word whose middle had been played."""
        end = 0
        for word in self.words:
            if (word.start_s + word.end_s) / 2 > played_s:
                break
            end = word.text_end
        return self.text[:end].strip()


def _is_cjk(word: str) -> bool:
    """A CJK character, and the punctuation after it."""
    return re.match(f"[{_CJK}]", word) is not None
