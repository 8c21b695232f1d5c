"""Frame sampling shared by every path, and the single-request generation loop: the simple reference path that
the batched engine is checked against."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.model.layers import KVCache
from engine.model.talker import Talker
from engine.prompt import Prompt
from engine.sampling import (
    SamplerBatch,
    SamplingParams,
    choose,
    draw_counter,
    process_talker_logits,
    talker_logits_mask,
)


@dataclass
class BatchSampling:
    """The sampling settings of a batch of requests as [B] tensors."""

    talker: SamplerBatch
    code_predictor: SamplerBatch
    penalty: torch.Tensor
    seeds: torch.Tensor
    min_frames: torch.Tensor

    @classmethod
    def of(cls, params: list[SamplingParams], device: torch.device | str = "cpu") -> "BatchSampling":
        return cls(SamplerBatch.of([p.talker for p in params], device),
                   SamplerBatch.of([p.code_predictor for p in params], device),
                   torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device),
                   torch.tensor([p.seed for p in params], dtype=torch.long, device=device),
                   torch.tensor([p.min_new_frames for p in params], dtype=torch.long, device=device))


def sample_frame(talker: Talker, hidden: torch.Tensor, seen: torch.Tensor, frame_index: torch.Tensor,
                 sampling: BatchSampling, suppressed: torch.Tensor) -> torch.Tensor:
    """Talker hidden states [B, H] -> one frame of codes [B, 16] per row (code 0 may be EOS)."""
    cfg = talker.cfg
    logits = process_talker_logits(talker.codec_head(hidden), seen, frame_index, sampling.min_frames,
                                   sampling.penalty, suppressed, cfg.codec_eos_token_id)
    code0 = choose(logits, sampling.talker, sampling.seeds, draw_counter(frame_index, 0, cfg.num_code_groups))

    def pick(group: int, sub_logits: torch.Tensor) -> torch.Tensor:
        counter = draw_counter(frame_index, group + 1, cfg.num_code_groups)
        return choose(sub_logits, sampling.code_predictor, sampling.seeds, counter)

    rest = talker.code_predictor.predict(hidden, talker.codec_embed(code0), pick)
    return torch.cat((code0[:, None], rest), dim=1)


@torch.inference_mode()
def generate_frames(talker: Talker, prompt: Prompt, sampling: SamplingParams, max_frames: int) -> Iterator[torch.Tensor]:
    """Yields frames [16] until EOS or `max_frames`."""
    cfg = talker.cfg
    device = prompt.prefill.device
    batch = BatchSampling.of([sampling], device)
    suppressed = talker_logits_mask(cfg.vocab_size, cfg.codec_eos_token_id, device)
    cache = KVCache.empty(cfg.layers.num_hidden_layers)
    hidden = talker.model.extend(prompt.prefill[None], cache)[:, -1]
    seen = torch.zeros(1, cfg.vocab_size, dtype=torch.bool, device=device)
    for step in range(max_frames):
        frame = sample_frame(talker, hidden, seen, torch.tensor([step], device=device), batch, suppressed)
        if frame[0, 0].item() == cfg.codec_eos_token_id:
            return
        yield frame[0]
        seen[0, frame[0, 0]] = True
        if step + 1 < max_frames:
            step_input = talker.frame_embed(frame) + prompt.text_track(step)
            hidden = talker.model.extend(step_input[:, None], cache)[:, -1]
