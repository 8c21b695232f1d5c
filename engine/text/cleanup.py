"""LLM output made speakable: markdown and emoji are not read out as symbols.

The rules (each applies to whitespace-separated words, so text that arrives in pieces is cleaned exactly as the
whole text would be; `StreamingCleanup` releases text only up to its last whitespace):
- at the start of a line: heading marks (`#` .. `######`), list markers (`-`, `*`, `+`, `1.`, `1)`), quote marks
  (`>`) and code fences (```` ``` ```` with or without a language) are dropped; the code inside a fence is kept; a
  number marker (`1.`, `1)`) is one only where more text follows it on its line (`42.` alone on its line is read);
- emphasis and code marks (`*`, `_`, `~`, `` ` ``) at the start or end of a word are dropped (`**bold**,` becomes
  `bold,`); inside a word they stay (`snake_case`, `2*3`);
- links `[text](url)` keep their text; a bare URL (`http://`, `https://`, `www.`) is read as its host name
  (`https://www.example.com/a?b=1` becomes `example.com`);
- emoji (pictographs, dingbats, flags, skin tones, variation selectors and joiners) are dropped;
- invisible format characters (zero-width spaces and non-joiners, word joiners, soft hyphens, direction marks and
  embeddings, the byte-order mark) are dropped: they say nothing, and as tokens they are frames of noise;
- a word that cleaning empties takes its following spaces with it, up to a line break.
"""
from __future__ import annotations

import re

_LINE_MARKER = re.compile(r"#{1,6}|[-*+>]|\d{1,3}[.)]|```\w*")
_NUMBER_MARKER = re.compile(r"\d{1,3}[.)]")
_NUMBER_START = re.compile(r"\d{1,3}")  # what a number marker may still grow from
_MARKS = "*_~`"  # emphasis and code
_NO_MARKS = str.maketrans("", "", _MARKS)
# a target stops at the next bracket or parenthesis, so the targets tried from each `](` never overlap and a word
# costs linear time (one running on over later `](` made a word of 16,000 characters take seconds of the step)
_LINK_TARGET = re.compile(r"\]\([^()\[\]\s]*\)")
_URL = re.compile(r"^(?:https?://|www\.)(?:www\.)?([^/\s?#:]+)\S*$")
_EMOJI = re.compile("[\U0001F000-\U0001FAFF\u2600-\u27BF\u2B00-\u2BFF\uFE0E\uFE0F\u200D\u20E3\U000E0020-\U000E007F]")
_INVISIBLE = re.compile("[\u00AD\u200B\u200C\u200E\u200F\u202A-\u202E\u2060-\u2064\u2066-\u2069\uFEFF]")
_WORDS = re.compile(r"(\s+)")
_LETTER_OR_DIGIT = re.compile(r"[^\W_]")


def speakable(text: str) -> bool:
    """Whether the text has anything to say: a letter or a digit, in any script. Punctuation, marks without a letter,
    spaces, zero-width, control and NUL characters alone make the model speak noise, not words: such text is empty."""
    return _LETTER_OR_DIGIT.search(text) is not None


def clean_word(word: str, line_start: bool, more_on_line: bool = True) -> str:
    """One word as it is spoken; `more_on_line`: more text follows it on its line (for a number marker)."""
    if line_start and _is_line_marker(word, more_on_line):
        return ""
    word = _INVISIBLE.sub("", _EMOJI.sub("", word))
    word = _LINK_TARGET.sub("", word).replace("[", "").replace("]", "")
    url = _URL.match(word)
    if url:
        return url.group(1)
    return _without_edge_marks(word)


def _is_line_marker(word: str, more_on_line: bool) -> bool:
    """A line-start word that marks up its line; a number marker only before more text on its line."""
    return _LINE_MARKER.fullmatch(word) is not None and (more_on_line or not is_number_marker(word))


def is_number_marker(word: str) -> bool:
    """A word that is a list marker at a line's start only if more text follows it there: which is told only once
    that text, or the line's end, has come (`StreamingCleanup` holds it until then)."""
    return _NUMBER_MARKER.fullmatch(word) is not None


def _without_edge_marks(word: str) -> str:
    """The word less its leading marks and every run of marks with no word character (\\w, `_` included) after
    it: what `^[*_~`]+|[*_~`]+(?=[^\\w]*$)` removes, in one pass (that regex took cubic time in the word's length,
    and a word of 4,000 marks stalled the engine's step for seconds)."""
    word = word.lstrip(_MARKS)
    last = len(word) - 1
    while last >= 0 and not _is_word_char(word[last]):
        last -= 1
    start = last + 1
    if last >= 0 and word[last] == "_":  # a mark and a word character: its whole run of marks goes
        start = last
        while start > 0 and word[start - 1] in _MARKS:
            start -= 1
    return word[:start] + word[start:].translate(_NO_MARKS)


def _is_word_char(char: str) -> bool:
    return char.isalnum() or char == "_"


class StreamingCleanup:
    def __init__(self) -> None:
        self._held = ""
        self._line_start = True
        self._dropped = False  # the last word was emptied: its following spaces go too

    def append(self, text: str) -> str:
        """Add text; returns the cleaned text up to its last whitespace (a number at a line's start with only spaces
        after it so far waits for what follows)."""
        self._held += text
        cut = max(self._held.rfind(c) for c in " \t\r\n\f\v") + 1 if self._held.strip() else 0
        done, self._held = self._held[:cut], self._held[cut:]
        return self._clean(done, final=False)

    def settle(self) -> str:
        """The text has paused: everything held, read as at the end, but for a number at a line's start that more
        text may still make a list marker (it waits)."""
        done, self._held = self._held, ""
        return self._clean(done, final=False)

    def finish(self) -> str:
        done, self._held = self._held, ""
        return self._clean(done, final=True)

    def _clean(self, text: str, final: bool) -> str:
        out = []
        parts = [part for part in _WORDS.split(text) if part]
        for index, part in enumerate(parts):
            if part.isspace():
                if "\n" in part:
                    self.line_break()
                    out.append(part[part.index("\n"):] if self._dropped else part)
                    self._dropped = False  # the spaces after a line break start the next line: they stay
                elif not self._dropped:
                    out.append(part)
                continue
            line_ends = index + 1 < len(parts) and "\n" in parts[index + 1]
            more_on_line = not line_ends and index + 2 < len(parts)
            growing = index == len(parts) - 1  # a pause's last word: the text after it may still extend it
            if not (final or line_ends or more_on_line) and self.waits(part, growing):
                self._held = "".join(parts[index:]) + self._held  # told by what comes next
                break
            cleaned = self.word(part, more_on_line)
            self._dropped = not cleaned
            out.append(cleaned)
        return "".join(out)

    def waits(self, word: str, growing: bool = False) -> bool:
        """Whether this word, next on its line, is read only once it is known whether more text follows it there:
        a number at a line's start, or digits there that a word still `growing` may make one ("4" of "42.")."""
        return self._line_start and (is_number_marker(word) or growing and _NUMBER_START.fullmatch(word) is not None)

    def word(self, word: str, more_on_line: bool) -> str:
        """One word (no whitespace in it) as it is spoken, given the words before it on its line and whether more
        text follows it there: a list marker is dropped only where it starts its line; one marker a line."""
        cleaned = clean_word(word, self._line_start, more_on_line)
        marker = self._line_start and _is_line_marker(word, more_on_line)
        self._line_start = self._line_start and not cleaned and not marker
        return cleaned

    def line_break(self) -> None:
        """The next word starts a line."""
        self._line_start = True


def clean_text(text: str) -> str:
    cleanup = StreamingCleanup()
    return cleanup.append(text) + cleanup.finish()
