"""Text that arrives in pieces (LLM tokens, partial words, sentences) as the talker's text track.

`IncrementalTokenizer` gives the same ids as tokenizing the whole text at once: BPE never merges across
pre-tokens, so an id is final once its pre-token is, and appending text can only change the last two pre-tokens (a
word that grows, "'" that becomes "'s", trailing spaces that leave one to the next word). The cut also avoids a
place where Unicode normalisation (NFC) could join the characters on its two sides. Text that has paused (`settle`:
the gateway saw no new text for a while) gives up its last words too, all but trailing spaces, so that "Okay sure
thing" is spoken while its client waits; the ids stay the whole text's unless the text after the pause continues
the last pre-token itself ("thing" then "s", "!\n" then "\n").

`TextFeed` is one request's text track in the streaming layout: one token per frame, `tts_eos` once the input has
ended, then `tts_pad`; `None` while the next token has not arrived, which is when the engine holds the request.
"""
from __future__ import annotations

import unicodedata

from tokenizers import Encoding

from engine.text.cleanup import StreamingCleanup
from engine.text.tokenizer import ROLE_IDS, ROLE_WORD, TextTokenizer

HELD_PRE_TOKENS = 2


class IncrementalTokenizer:
    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer.plain  # a control-token string in the text is read as text (TextTokenizer)
        self._pending = ROLE_WORD  # tokenized in context, as the whole text would be; its role ids are dropped
        self._role_ids = ROLE_IDS - 1  # its marker is not in `_pending`
        self.text = ""

    def append(self, text: str) -> list[int]:
        """Add text; returns the ids that became final."""
        self.text += text
        self._pending += text
        encoding, starts = self._pre_tokens()
        for start in reversed(starts[1:len(starts) - HELD_PRE_TOKENS + 1]):
            if start >= self._head() and _joinable_cut(self._pending, start):
                return self._commit(encoding, start)
        return []

    def settle(self) -> list[int]:
        """The text has paused: the ids of all of it but its trailing pre-tokens of spaces alone (they may still
        join the next word). The cut is a pre-token's end, so no id crosses it ("!" and the newlines after it are
        one pre-token)."""
        encoding, starts = self._pre_tokens()
        ends = [*starts[1:], len(self._pending)]
        while starts and self._pending[starts[-1]:ends[len(starts) - 1]].isspace():
            starts.pop()
        cut = ends[len(starts) - 1] if starts else 0
        if cut <= self._head() or (cut < len(self._pending) and not _joinable_cut(self._pending, cut)):
            return []
        return self._commit(encoding, cut)

    def finish(self) -> list[int]:
        """The end of the input: the remaining ids (the template's end marker that follows bounds them)."""
        ids = self.tokenizer.encode(self._pending, add_special_tokens=False).ids
        self._pending = ""
        return self._drop_role(ids)

    def _head(self) -> int:
        return len(ROLE_WORD) if self._role_ids else 0

    def _pre_tokens(self) -> tuple[Encoding, list[int]]:
        """The pending text's encoding and where each of its pre-tokens starts in it. The pre-tokens are those of
        the normalised (NFC) text, as the ids are, mapped back onto the text as given: split by the given text's
        own pre-tokens, decomposed text (macOS's "e" + U+0301) was cut inside one of the normalised text's, and the
        word across the cut lost characters."""
        encoding = self.tokenizer.encode(self._pending, add_special_tokens=False)
        starts: list[int] = []
        last = None
        for word, (start, _) in zip(encoding.word_ids, encoding.offsets):
            if word != last:
                starts.append(start)
                last = word
        return encoding, starts

    def _commit(self, encoding: Encoding, cut: int) -> list[int]:
        ids = [i for i, (_, end) in zip(encoding.ids, encoding.offsets) if end <= cut]
        self._pending = self._pending[cut:]
        return self._drop_role(ids)

    def _drop_role(self, ids: list[int]) -> list[int]:
        ids, self._role_ids = ids[self._role_ids:], 0
        return ids


def _joinable_cut(text: str, cut: int) -> bool:
    """Normalising the two sides apart gives what normalising them together gives (a starter that composes with
    nothing before it)."""
    before, after = text[cut - 1], text[cut]
    return (unicodedata.combining(after) == 0 and
            unicodedata.normalize("NFC", before + after) ==
            unicodedata.normalize("NFC", before) + unicodedata.normalize("NFC", after))


class TextFeed:
    def __init__(self, tokenizer: TextTokenizer, eos_id: int, pad_id: int, cleanup: bool = False) -> None:
        self._tokens = IncrementalTokenizer(tokenizer)
        self._cleanup = StreamingCleanup() if cleanup else None
        self.eos_id, self.pad_id = eos_id, pad_id
        self.ids: list[int] = []
        self.ended = False
        self.consumed = 0  # ids the prompt's prefill took; the frames read from there on

    @property
    def text(self) -> str:
        """The text the model reads (cleaned, when cleaning is on)."""
        return self._tokens.text

    def append(self, text: str) -> None:
        if self.ended:
            raise ValueError("text appended after the end of the input")
        self.ids += self._tokens.append(self._cleanup.append(text) if self._cleanup else text)

    def settle(self) -> None:
        """The text has paused: its words so far are read, the clean-up's held last word first
        (`IncrementalTokenizer.settle`)."""
        if not self.ended:
            if self._cleanup:
                self.ids += self._tokens.append(self._cleanup.settle())
            self.ids += self._tokens.settle()

    def end(self) -> None:
        if not self.ended:
            if self._cleanup:
                self.ids += self._tokens.append(self._cleanup.finish())
            self.ids += self._tokens.finish()
            self.ended = True

    def text_id(self, step: int) -> int | None:
        """The text-track token of decode step `step`; None: not arrived yet (hold)."""
        index = self.consumed + step
        if index < len(self.ids):
            return self.ids[index]
        if not self.ended:
            return None
        return self.eos_id if index == len(self.ids) else self.pad_id
