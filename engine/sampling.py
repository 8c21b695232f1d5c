"""Logits processors and samplers, matching the reference's Hugging Face `generate` configuration.

Talker (codebook 0): repetition penalty over the codes generated so far -> EOS banned for the first
`MIN_NEW_FRAMES` frames -> control ids suppressed except EOS -> temperature -> top-k -> top-p.
Code predictor (codebooks 1..15): temperature -> top-k -> top-p. Greedy takes the argmax after the processors.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.config import GenerationDefaults

MIN_NEW_FRAMES = 2  # the reference passes min_new_tokens=2


@dataclass(frozen=True)
class SamplerParams:
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float


@dataclass(frozen=True)
class SamplingParams:
    talker: SamplerParams
    code_predictor: SamplerParams
    repetition_penalty: float
    seed: int | None = None

    @classmethod
    def from_defaults(cls, defaults: GenerationDefaults, *, greedy: bool = False,
                      seed: int | None = None) -> "SamplingParams":
        talker = SamplerParams(defaults.do_sample and not greedy, defaults.temperature, defaults.top_k,
                               defaults.top_p)
        sub = SamplerParams(defaults.subtalker_dosample and not greedy, defaults.subtalker_temperature,
                            defaults.subtalker_top_k, defaults.subtalker_top_p)
        return cls(talker, sub, defaults.repetition_penalty, seed)

    def greedy(self) -> "SamplingParams":
        return replace(self, talker=replace(self.talker, do_sample=False),
                       code_predictor=replace(self.code_predictor, do_sample=False))


def apply_repetition_penalty(logits: torch.Tensor, previous: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits [B, V]; previous [B, n] ids already generated: each distinct id is penalised once."""
    if penalty == 1.0 or previous.shape[-1] == 0:
        return logits
    score = logits.gather(-1, previous)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return logits.scatter(-1, previous, score)


def talker_logits_mask(vocab_size: int, eos_id: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean [V]: the top 1024 ids are control ids, never sampled, except EOS."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    mask[vocab_size - 1024:] = True
    mask[eos_id] = False
    return mask


def process_talker_logits(logits: torch.Tensor, previous: torch.Tensor, frame_index: int, penalty: float,
                          suppressed: torch.Tensor, eos_id: int) -> torch.Tensor:
    logits = apply_repetition_penalty(logits, previous, penalty)
    logits = logits.masked_fill(suppressed, float("-inf"))
    if frame_index < MIN_NEW_FRAMES:
        logits[..., eos_id] = float("-inf")
    return logits


def warp(logits: torch.Tensor, params: SamplerParams) -> torch.Tensor:
    """Temperature, top-k (ties at the k-th value kept) and top-p (the smallest set reaching p kept)."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - params.top_p)
        drop_sorted[..., -1:] = False
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logits


def choose(logits: torch.Tensor, params: SamplerParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] -> ids [B]."""
    if not params.do_sample:
        return logits.argmax(dim=-1)
    probs = warp(logits.float(), params).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
