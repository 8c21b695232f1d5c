"""The text tokenizer (read from the checkpoint's own files) and the reference's chat templates.

Checkpoints ship `vocab.json`, `merges.txt` and `tokenizer_config.json`; we build a byte-level BPE from them with the
Qwen pre-tokenizer regex, exactly as the files describe it, with `tokenizers` alone (no transformers).
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from engine.errors import CheckpointError
from engine.synthetic.tokenizer_files import FILES as TOKENIZER_FILES
from engine.synthetic.tokenizer_files import QWEN_SPLIT_PATTERN


def _special_tokens(config_path: Path) -> list[tuple[int, str]]:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        decoder = config["added_tokens_decoder"]
        return sorted((int(i), entry["content"]) for i, entry in decoder.items())
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"malformed tokenizer file {config_path}: {exc}") from exc


def load_tokenizer(model_dir: Path) -> Tokenizer:
    for name in TOKENIZER_FILES:
        if not (model_dir / name).is_file():
            raise CheckpointError(f"missing checkpoint file: {model_dir / name}")
    try:
        bpe = BPE.from_file(str(model_dir / "vocab.json"), str(model_dir / "merges.txt"))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise CheckpointError(f"malformed tokenizer files vocab.json / merges.txt in {model_dir}: {exc}") from exc
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    for token_id, content in _special_tokens(model_dir / "tokenizer_config.json"):
        tokenizer.add_special_tokens([AddedToken(content, special=True, normalized=False)])
        if tokenizer.token_to_id(content) != token_id:
            raise CheckpointError(
                f"tokenizer_config.json: special token {content!r} should have id {token_id} "
                f"but the vocabulary gives it {tokenizer.token_to_id(content)}"
            )
    return tokenizer


IM_START, IM_END = "<|im_start|>", "<|im_end|>"
ROLE_WORD = "assistant\n"  # the role's text after its marker: a client's text is tokenized in context after it
ROLE_PREFIX = IM_START + ROLE_WORD
ROLE_IDS = 3  # the reference slices its template's first 3 ids as the role: the marker, then ROLE_WORD's 2 in context


def plain_text(tokenizer: Tokenizer) -> Tokenizer:
    """`tokenizer` without its control tokens, so that it reads their strings as text: the same BPE (shared, not
    copied), normaliser, pre-tokenizer and decoder."""
    plain = Tokenizer(tokenizer.model)
    plain.normalizer, plain.pre_tokenizer = tokenizer.normalizer, tokenizer.pre_tokenizer
    plain.decoder = tokenizer.decoder
    return plain


class TextTokenizer:
    """Token ids for the three prompt pieces, sliced exactly as the reference slices its templates.

    A client's text is read as text: a string in it that spells a control token (`<|im_end|>`, `<tts_text_eod>`,
    `<think>`) is tokenized as its characters (`plain`), and only the templates' own markers are control tokens. The
    reference encodes the filled template whole, so there such a string becomes the control itself, and a request
    could end or derail its own speech. A control token also bounds the text around it for the pre-tokenizer, so
    the text between the markers, encoded alone, gives the ids it has in the whole template."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.plain = plain_text(tokenizer)
        self._role_ids = tuple(self.encode(ROLE_PREFIX))  # every prompt has it: encoded once, not per request
        self._markers = tuple(self.encode(IM_START + IM_END))

    def encode(self, text: str) -> list[int]:
        """Ids of a template's own text, its control tokens read as controls."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def text_ids(self, text: str) -> list[int]:
        """Ids of text between two control tokens, every character read as text."""
        return self.plain.encode(text, add_special_tokens=False).ids

    def target(self, text: str) -> tuple[list[int], list[int]]:
        """(role ids `<|im_start|>assistant\\n`, text ids) of the text to speak: of the reference's template
        `<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n`, its first 3 ids and all but its
        last 5."""
        ids = self.text_ids(ROLE_WORD + text)
        return [self._markers[0], *ids[:ROLE_IDS - 1]], ids[ROLE_IDS - 1:]

    def role_ids(self) -> list[int]:
        return list(self._role_ids)

    def reference_text(self, text: str) -> list[int]:
        """Text ids of a voice-clone reference transcript: `<|im_start|>assistant\\n{text}<|im_end|>\\n` but its first 3
        ids and its last 2."""
        return self.text_ids(ROLE_WORD + text)[ROLE_IDS - 1:]

    def instruction(self, text: str) -> list[int]:
        """The whole instruction block `<|im_start|>user\\n{text}<|im_end|>\\n`, role and end marker included."""
        start, end = self._markers
        return [start, *self.text_ids(f"user\n{text}"), end, *self.text_ids("\n")]
