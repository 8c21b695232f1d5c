"""A synthesis request, the events it produces, and what it must be before the engine takes it: one check, used by
`Engine.submit` and by both asyncio front ends at their own submit, so that an invalid request is refused at once
wherever it comes from and never reaches the step loop. Only cheap checks live here (no tokenizing, no model work);
what only the model can tell (an over-long prompt, text that cleans up to nothing) fails the request later, with its
own typed error."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np

from engine.config import RANDOM_WEIGHTS_KEY, ModelConfig
from engine.errors import BenchmarkOnlyError, EmptyText, RequestError, VoxgateError
from engine.prompt import TEXT_LAYOUTS, Voice
from engine.sampling import SamplerParams, SamplingParams
from engine.text.cleanup import speakable

if TYPE_CHECKING:
    from engine.tts import TTSModel


@dataclass(frozen=True)
class RunawayGuard:
    """A length limit from the text length, so a model that never emits EOS stops by itself.

    Real speech takes roughly 2-4 frames (80 ms each) per text token; the default allows 10 per token plus a
    2-second floor, far above any normal reading but a bound on a runaway."""

    frames_per_token: float = 10.0
    min_frames: int = 25

    def limit(self, text_tokens: int) -> int:
        return max(self.min_frames, math.ceil(self.frames_per_token * text_tokens))


EOS_BANNED = 2**31 - 1  # a min_new_frames that bans EOS for good (the largest check_sampling allows)


@dataclass(frozen=True)
class SyntheticLength:
    """Benchmark-only: a random-weight checkpoint never emits EOS, so each request would run to the runaway guard
    (~3x real speech). This holds each request to exactly ceil(frames_per_token x its text tokens) frames, or its
    explicit max_frames if fewer, with no floor and with EOS banned so that nothing ends it sooner."""

    frames_per_token: float

    def __post_init__(self) -> None:
        check_frames_per_token(self.frames_per_token, "synthetic_frames_per_token")

    @classmethod
    def for_model(cls, frames_per_token: float, config: ModelConfig, model: str,
                  option: str = "synthetic_frames_per_token") -> SyntheticLength:
        """Refused (BenchmarkOnlyError, a ValueError) for a checkpoint not marked as random weights, so that it can
        never cut a real model's speech; `model` and `option` name the checkpoint and the setting in the message."""
        check_frames_per_token(frames_per_token, option)
        if not config.random_weights:
            raise BenchmarkOnlyError(f"{option} is benchmark-only and needs a random-weight checkpoint (config.json "
                                     f"with \"{RANDOM_WEIGHTS_KEY}\": true, as voxgate make-checkpoint writes); "
                                     f"{model} is not marked as one")
        return cls(frames_per_token)

    def limit(self, text_tokens: int, max_frames: int | None = None) -> int:
        """The request's frames. The product is taken as the number was written (0.1 x 30 tokens is 3 frames, not
        the 4 of binary rounding)."""
        exact = math.ceil(Fraction(repr(float(self.frames_per_token))) * text_tokens)
        return exact if max_frames is None else min(max_frames, exact)

    def sampling(self, sampling: SamplingParams) -> SamplingParams:
        """EOS banned: the length alone ends the request."""
        return replace(sampling, min_new_frames=EOS_BANNED)


@dataclass(frozen=True)
class SynthesisRequest:
    text: str
    voice: Voice
    language: str = "auto"
    layout: str | None = None
    sampling: SamplingParams | None = None
    max_frames: int | None = None
    text_complete: bool = True  # False: `text` is the first piece; more comes with append_text, then end_text
    clean_text: bool = False  # LLM output: markdown and emoji are not read out (engine/text/cleanup.py)
    # a live conversation's request (the gateway's WebSocket contexts); False: a one-shot request (HTTP), which leaves
    # the engine's reserved slots and places to the interactive ones (scheduler.py, `reserved_slots`)
    interactive: bool = True
    # who asks (the gateway: a session, or an HTTP client's API key); requests waiting for a slot take turns by owner,
    # fewest running first (scheduler.py); None: a client of its own
    owner: str | None = None


@dataclass(frozen=True)
class AudioChunk:
    request_id: int
    start_sample: int  # position of samples[0] in the request's audio
    samples: np.ndarray  # float32 mono


@dataclass(frozen=True)
class Finished:
    request_id: int
    reason: str  # "eos" | "length" | "error"
    frames: int
    error: VoxgateError | None = None  # set when reason is "error"


Event = AudioChunk | Finished


SEED_RANGE = 2**63  # seeds are 0..2**63-1: they go to the device as int64


def check_text(field: str, text: object) -> None:
    """A str the tokenizer can read: valid Unicode (a lone surrogate would raise inside the tokenizer)."""
    if not isinstance(text, str):
        raise RequestError(f"{field} must be a string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{field} is not valid Unicode (it has a lone surrogate)") from None


def check_request(tts: TTSModel, request: SynthesisRequest) -> None:
    """Raises RequestError (EmptyText for a complete text with nothing to speak) naming what is wrong."""
    check_text("text", request.text)
    if request.text_complete and not speakable(request.text):
        raise EmptyText()
    if request.voice.instruct is not None:
        check_text("instruct", request.voice.instruct)
    if request.language is not None:
        check_text("language", request.language)
    tts.resolve_language(request.language)
    if request.layout is not None and request.layout not in TEXT_LAYOUTS:
        raise RequestError(f"unknown text layout {request.layout!r}; use one of {', '.join(TEXT_LAYOUTS)}")
    if not request.text_complete and request.layout not in (None, "streaming"):
        raise RequestError("streaming text needs the streaming text layout")
    if request.max_frames is not None and not (_is_int(request.max_frames) and request.max_frames >= 1):
        raise RequestError("max_frames must be an integer of at least 1")
    if request.sampling is not None:
        check_sampling(request.sampling)


def check_sampling(sampling: SamplingParams) -> None:
    """Numbers the step can put in its tensors: a seed that fits int64, finite positive settings."""
    if not (_is_int(sampling.seed) and 0 <= sampling.seed < SEED_RANGE):
        raise RequestError(f"seed must be an integer from 0 to {SEED_RANGE - 1}")
    if not (_is_int(sampling.min_new_frames) and 0 <= sampling.min_new_frames < 2**31):
        raise RequestError("min_new_frames must be a non-negative integer")
    if not (_is_number(sampling.repetition_penalty) and sampling.repetition_penalty > 0):
        raise RequestError("repetition_penalty must be a positive number")
    for name, sampler in (("talker", sampling.talker), ("code_predictor", sampling.code_predictor)):
        _check_sampler(name, sampler)


def _check_sampler(name: str, sampler: SamplerParams) -> None:
    if not (_is_number(sampler.temperature) and sampler.temperature > 0):
        raise RequestError(f"{name} temperature must be a positive number")
    if not (_is_int(sampler.top_k) and 0 <= sampler.top_k < 2**31):
        raise RequestError(f"{name} top_k must be a non-negative integer")
    if not (_is_number(sampler.top_p) and 0 <= sampler.top_p <= 1):
        raise RequestError(f"{name} top_p must be a number from 0 to 1")


def check_frames_per_token(value: object, option: str) -> None:
    """A synthetic length's frames per token (SyntheticLength): positive and finite."""
    if not (_is_number(value) and value > 0):
        raise BenchmarkOnlyError(f"{option} must be a positive finite number, not {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
