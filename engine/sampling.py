"""Logits processors and samplers, matching the reference's Hugging Face `generate` configuration, batched with
per-row parameters.

Talker (codebook 0): repetition penalty over the codes generated so far -> EOS banned for the first
`MIN_NEW_FRAMES` frames -> control ids suppressed except EOS -> temperature -> top-k -> top-p.
Code predictor (codebooks 1..15): temperature -> top-k -> top-p. Greedy takes the argmax after the processors.

Sampling is Gumbel-max with counter-based noise: the noise of a draw is a hash of (seed, frame, codebook, token),
so a request's output depends only on its own seed and logits, never on what else shares the batch or when it
joined, and the same code runs on the CPU and inside a CUDA graph (no generator state, no host sync).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import GenerationDefaults

MIN_NEW_FRAMES = 2  # the reference passes min_new_tokens=2
_MASK32 = 0xFFFFFFFF


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
    seed: int = 0
    min_new_frames: int = MIN_NEW_FRAMES  # EOS is banned before this many frames (benchmarks raise it)

    @classmethod
    def from_defaults(cls, defaults: GenerationDefaults, *, greedy: bool = False,
                      seed: int | None = None) -> "SamplingParams":
        talker = SamplerParams(defaults.do_sample and not greedy, defaults.temperature, defaults.top_k,
                               defaults.top_p)
        sub = SamplerParams(defaults.subtalker_dosample and not greedy, defaults.subtalker_temperature,
                            defaults.subtalker_top_k, defaults.subtalker_top_p)
        return cls(talker, sub, defaults.repetition_penalty, 0 if seed is None else seed)


@dataclass
class SamplerBatch:
    """One sampler's parameters as [B] tensors, one row per request."""

    do_sample: torch.Tensor  # bool
    temperature: torch.Tensor  # float
    top_k: torch.Tensor  # long, 0 = off
    top_p: torch.Tensor  # float, 1.0 = off

    @classmethod
    def of(cls, params: list[SamplerParams], device: torch.device | str = "cpu") -> "SamplerBatch":
        return cls(
            do_sample=torch.tensor([p.do_sample for p in params], dtype=torch.bool, device=device),
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        )


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """logits [B, V]; seen [B, V] bool (ids generated so far); penalty [B]. Each seen id is penalised once."""
    p = penalty[:, None].to(logits.dtype)
    return torch.where(seen, torch.where(logits < 0, logits * p, logits / p), logits)


def talker_logits_mask(vocab_size: int, eos_id: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean [V]: the top 1024 ids are control ids, never sampled, except EOS."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    mask[vocab_size - 1024:] = True
    mask[eos_id] = False
    return mask


def process_talker_logits(logits: torch.Tensor, seen: torch.Tensor, frame_index: torch.Tensor,
                          min_frames: torch.Tensor, penalty: torch.Tensor, suppressed: torch.Tensor,
                          eos_id: int) -> torch.Tensor:
    """frame_index [B]: frames this request has produced so far; EOS is banned while it is below min_frames [B]."""
    logits = apply_repetition_penalty(logits, seen, penalty)
    logits = logits.masked_fill(suppressed, float("-inf"))
    is_eos = torch.arange(logits.shape[-1], device=logits.device) == eos_id
    return logits.masked_fill((frame_index < min_frames)[:, None] & is_eos, float("-inf"))


def warp(logits: torch.Tensor, params: SamplerBatch) -> torch.Tensor:
    """Temperature, top-k (ties at the k-th value kept) and top-p (the smallest set reaching p kept), per row.

    Both cut-offs become a threshold value per row, so no index leaves the sorted space (no gather/scatter)."""
    logits = logits / params.temperature[:, None]
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)
    descending = torch.sort(logits, dim=-1, descending=True).values
    k = torch.where(params.top_k > 0, params.top_k.clamp(max=vocab), vocab)
    kth = torch.where(ranks[None] < k[:, None], descending, float("inf")).amin(dim=-1, keepdim=True)
    logits = logits.masked_fill(logits < kth, float("-inf"))
    ascending = torch.sort(logits, dim=-1).values
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = (cumulative <= (1 - params.top_p)[:, None]) & (ranks[None] < vocab - 1)
    cut = torch.where(drop, float("inf"), ascending).amin(dim=-1, keepdim=True)
    return logits.masked_fill(logits < cut, float("-inf"))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (values stay below 2**59 in int64, so nothing overflows on any device)."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] Gumbel noise that is a pure function of (seed, counter, token) per row."""
    seeds = seeds.long()
    row = _mix32(_mix32(seeds & _MASK32) ^ ((seeds >> 32) & _MASK32))
    row = _mix32(row ^ _mix32(counters.long() & _MASK32))
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.long)
    bits = _mix32(row[:, None] ^ ((tokens * 0x27D4EB2F) & _MASK32)) >> 9
    return -torch.log(-torch.log(uniform_from_bits(bits)))


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """23 random bits -> a float32 strictly inside (0, 1). With 24 bits, (2**24 - 1 + 0.5) rounds to 2**24 in
    float32, u becomes 1, its Gumbel noise +inf, and -inf + inf = NaN let a suppressed token win the argmax."""
    return (bits.float() + 0.5) / float(1 << 23)


def choose(logits: torch.Tensor, params: SamplerBatch, seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> ids [B]: argmax for greedy rows, a Gumbel-max draw for sampling rows."""
    greedy = logits.argmax(dim=-1)
    noisy = warp(logits.float(), params) + gumbel_noise(seeds, counters, logits.shape[-1])
    return torch.where(params.do_sample, noisy.argmax(dim=-1), greedy)


def draw_counter(frame_index: torch.Tensor, group: int, groups: int = 16) -> torch.Tensor:
    """The noise counter of codebook `group` of frame `frame_index`: distinct for every draw of a request."""
    return frame_index * groups + group
