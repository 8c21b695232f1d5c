"""How the words of the server's `timestamps` events join into text: the server sends CJK text a character (with
its punctuation) per word, with no spaces between them in the text; other words were separated by spaces."""
from __future__ import annotations

import unicodedata


def is_wide(character: str) -> bool:
    """A wide (CJK) character: text in such scripts has no spaces between its words."""
    return unicodedata.east_asian_width(character) in ("W", "F")


def spaced(word: str) -> str:
    """The word as a transcript joins it: a space after it, but not after a CJK one."""
    return word if word and is_wide(word[-1]) else word + " "
