"""Talker prompts for the four modes, position by position as the reference lays them out.

Each position is the sum of a text-track vector T(id) and a codec-track vector C(id). A prompt is the prefill
(all positions before the first generated frame) plus the text track still to feed: in the streaming text layout
one text vector per generated frame, then `tts_pad` forever.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial

import torch

from engine.config import ModelConfig
from engine.model.talker import Talker
from engine.transfer import upload

TEXT_LAYOUTS = ("prefill", "streaming")


@dataclass(frozen=True)
class Voice:
    """Who speaks. Exactly one of the fields that fit the model's type is set (validated by the caller)."""

    speaker: str | None = None  # CustomVoice: a built-in speaker
    instruct: str | None = None  # VoiceDesign (required) or CustomVoice 1.7B (optional style)
    xvector: torch.Tensor | None = None  # Base: speaker embedding of the reference audio
    ref_codes: torch.Tensor | None = None  # Base ICL: [T_ref, 16] codes of the reference audio
    ref_text_ids: list[int] | None = None  # Base ICL: its transcript


@dataclass
class Prompt:
    prefill: torch.Tensor  # [P, H]
    pad: torch.Tensor  # [H]: text track after the trailing text
    trailing_ids: list[int]  # the ids behind trailing_text (tts_eos included)
    pad_id: int
    # builds trailing_text when first asked: only the single-request path reads the vectors; the engine feeds the
    # ids, which its step embeds, so a request it admits costs no kernels for them
    build_trailing: Callable[[], torch.Tensor]

    @cached_property
    def trailing_text(self) -> torch.Tensor:
        """[N, H]: the text track of decode steps 0..N-1."""
        with torch.inference_mode():
            return self.build_trailing()

    def text_track(self, step: int) -> torch.Tensor:
        return self.trailing_text[step] if step < self.trailing_text.shape[0] else self.pad

    def text_id(self, step: int) -> int:
        """The text-track token of decode step `step` (what the batched engine feeds)."""
        return self.trailing_ids[step] if step < len(self.trailing_ids) else self.pad_id


def language_id(config: ModelConfig, language: str, speaker: str | None) -> int | None:
    """The codec language id, None for `auto`; dialect speakers speak their dialect for Chinese and auto."""
    language = language.lower()
    lang_id = None if language == "auto" else config.talker.codec_language_id[language]
    dialect = config.talker.spk_is_dialect.get(speaker.lower(), False) if speaker else False
    if dialect and language in ("chinese", "auto"):
        lang_id = config.talker.codec_language_id[dialect]
    return lang_id


PREFIXES_KEPT = 64  # voices (with their instruction, language and role) whose prompt prefix is kept
PREFIX_ROWS_KEPT = 256  # the longest prefix kept (~1 MB at the 1.7B's width): at most ~64 MB in all
FIRST_TOKENS_KEPT = 4096  # text vectors of a streaming prompt's first token kept (4 KB each at the 1.7B's width)


class _Kept(OrderedDict):
    """What a builder keeps, bounded: past its limit the entry used longest ago goes."""

    def find(self, key):
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value

    def keep(self, key, value, limit: int):
        self[key] = value
        if len(self) > limit:
            self.popitem(last=False)
        return value


class PromptBuilder:
    """Builds prompts; what every prompt of a voice shares (the special tokens' text vectors, the prefix of
    instruction, role and codec tags) is computed once and kept, and so is the text vector of a streaming prompt's
    first token, so that a burst of new requests costs two small kernels each (docs/benchmarks.md, "Where a burst's
    time goes", "A burst's admission"). What is kept is the very tensor a new build would compute: the same kernels
    on the same inputs."""

    def __init__(self, config: ModelConfig, talker: Talker) -> None:
        self.config = config
        self.talker = talker
        self._special: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # (speaker, role, instruction, language) -> the prefix pieces and C(codec_bos)
        self._prefixes: _Kept[tuple, tuple[list[torch.Tensor], torch.Tensor]] = _Kept()
        self._first_tokens: _Kept[int, torch.Tensor] = _Kept()  # id -> its text vector [1, H]

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return upload(torch.tensor(ids, dtype=torch.long), self.talker.codec_head.weight.device)

    def text(self, ids: list[int]) -> torch.Tensor:
        return self.talker.text_embed(self._ids(ids))

    def codec(self, ids: list[int]) -> torch.Tensor:
        return self.talker.codec_embed(self._ids(ids))

    def build(self, voice: Voice, role_ids: list[int], text_ids: list[int], instruct_ids: list[int] | None,
              language: str, layout: str) -> Prompt:
        cfg = self.config
        if self._special is None:
            self._special = self.text([cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id]).unbind()
        bos_t, eos_t, pad_t = self._special
        prefix, codec_bos = self._kept_prefix(voice, role_ids, instruct_ids, language, bos_t, pad_t)
        if voice.ref_codes is not None:
            body, trailing, trailing_ids = self._icl(voice, text_ids, codec_bos, eos_t, pad_t, layout)
        elif layout == "streaming":
            body = self._first_token(text_ids) + codec_bos
            trailing_ids = [*text_ids[1:], cfg.tts_eos_token_id]
            trailing = partial(self._with_eos, text_ids[1:], eos_t)  # a copy: the caller's list may grow
        else:
            text_part = torch.cat((self.text(text_ids), eos_t[None]))
            body = torch.cat((text_part + self.codec([cfg.talker.codec_pad_id]), (pad_t + codec_bos)[None]))
            trailing_ids, trailing = [], partial(_no_text, pad_t)
        return Prompt(prefill=torch.cat([*prefix, body]), pad=pad_t, trailing_ids=trailing_ids,
                      pad_id=cfg.tts_pad_token_id, build_trailing=trailing)

    def _with_eos(self, ids: list[int], eos_t: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.text(ids), eos_t[None]))

    def _first_token(self, text_ids: list[int]) -> torch.Tensor:
        """T(first id) [1, H] (none: [0, H]), kept: what `self.text(text_ids[:1])` computes."""
        if not text_ids:
            return self.text([])
        first = text_ids[0]
        kept = self._first_tokens.find(first)
        return kept if kept is not None else self._first_tokens.keep(first, self.text([first]), FIRST_TOKENS_KEPT)

    def _kept_prefix(self, voice: Voice, role_ids: list[int], instruct_ids: list[int] | None, language: str,
                     bos_t: torch.Tensor, pad_t: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """`_prefix`, kept for a built-in speaker or an instruction of up to `PREFIX_ROWS_KEPT` rows. A cloned
        voice's is built each time: its x-vector comes unpickled with every request in the engine process, so no
        key would find it again."""
        if voice.xvector is not None:
            return self._prefix(voice, role_ids, instruct_ids, language, bos_t, pad_t)
        key = (voice.speaker, tuple(role_ids), None if instruct_ids is None else tuple(instruct_ids), language)
        kept = self._prefixes.find(key)
        if kept is not None:
            return kept
        prefix, codec_bos = self._prefix(voice, role_ids, instruct_ids, language, bos_t, pad_t)
        if sum(piece.shape[0] for piece in prefix) <= PREFIX_ROWS_KEPT:  # a long instruction is not kept
            self._prefixes.keep(key, (prefix, codec_bos), PREFIXES_KEPT)
        return prefix, codec_bos

    def _prefix(self, voice: Voice, role_ids: list[int], instruct_ids: list[int] | None, language: str,
                bos_t: torch.Tensor, pad_t: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Instruction, role, then the codec tags (think, language, speaker) under tts_pad ... tts_bos.

        Returns the prefix pieces and C(codec_bos), which the body places under the first text position."""
        tcfg = self.config.talker
        lang_id = language_id(self.config, language, voice.speaker)
        tags = ([tcfg.codec_nothink_id, tcfg.codec_think_bos_id, tcfg.codec_think_eos_id] if lang_id is None else
                [tcfg.codec_think_id, tcfg.codec_think_bos_id, lang_id, tcfg.codec_think_eos_id])
        codec = [self.codec(tags)]
        speaker = self._speaker_vector(voice)
        if speaker is not None:
            codec.append(speaker[None])
        codec.append(self.codec([tcfg.codec_pad_id, tcfg.codec_bos_id]))
        codec_track = torch.cat(codec)
        text_track = torch.cat((pad_t.expand(codec_track.shape[0] - 2, -1), bos_t[None]))
        prefix = [] if instruct_ids is None else [self.text(instruct_ids)]
        prefix += [self.text(role_ids), text_track + codec_track[:-1]]
        return prefix, codec_track[-1]

    def _speaker_vector(self, voice: Voice) -> torch.Tensor | None:
        if voice.xvector is not None:
            return voice.xvector.to(self.talker.codec_head.weight)
        if voice.speaker:
            return self.codec([self.config.talker.spk_id[voice.speaker.lower()]])[0]
        return None

    def _icl(self, voice: Voice, text_ids: list[int], codec_bos: torch.Tensor, eos_t: torch.Tensor,
             pad_t: torch.Tensor, layout: str) -> tuple[torch.Tensor, Callable[[], torch.Tensor], list[int]]:
        """Reference transcript + target text against codec bos + the reference frames.

        Returns the prefill body and the text track left for the decode steps, as a builder of its vectors and as
        ids."""
        ids = [*voice.ref_text_ids, *text_ids]
        text = torch.cat((self.text(ids), eos_t[None]))
        ref = voice.ref_codes.to(codec_bos.device)
        codec = torch.cat((codec_bos[None], self.talker.frame_embed(ref)))
        if layout == "prefill":
            body = torch.cat((text + self.codec([self.config.talker.codec_pad_id]), codec + pad_t))
            return body, partial(_no_text, pad_t), []
        n = codec.shape[0]
        if text.shape[0] > n:
            rest = text[n:]
            return text[:n] + codec, lambda: rest, [*ids, self.config.tts_eos_token_id][n:]
        padded = torch.cat((text, pad_t.expand(n - text.shape[0], -1)))
        return padded + codec, partial(_no_text, pad_t), []


def _no_text(pad_t: torch.Tensor) -> torch.Tensor:
    """An empty text track: every decode step reads tts_pad."""
    return pad_t.new_zeros(0, pad_t.shape[-1])
