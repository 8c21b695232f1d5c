"""The single-request generation loop: the simple reference path that batched fast paths are checked against."""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.model.layers import KVCache
from engine.model.talker import Talker
from engine.prompt import Prompt
from engine.sampling import SamplingParams, choose, process_talker_logits, talker_logits_mask


@dataclass(frozen=True)
class RunawayGuard:
    """A length limit from the text length, so a model that never emits EOS stops by itself.

    Real speech takes roughly 2-4 frames (80 ms each) per text token; the default allows 10 per token plus a
    2-second floor, far above any normal reading but a bound on a runaway."""

    frames_per_token: float = 10.0
    min_frames: int = 25

    def limit(self, text_tokens: int) -> int:
        return max(self.min_frames, math.ceil(self.frames_per_token * text_tokens))


@torch.inference_mode()
def generate_frames(talker: Talker, prompt: Prompt, sampling: SamplingParams, max_frames: int) -> Iterator[torch.Tensor]:
    """Yields frames [16] until EOS or `max_frames`."""
    cfg = talker.cfg
    device = prompt.prefill.device
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    suppressed = talker_logits_mask(cfg.vocab_size, cfg.codec_eos_token_id, device)
    cache = KVCache.empty(cfg.layers.num_hidden_layers)
    hidden = talker.model(prompt.prefill[None], cache)[:, -1]
    previous = torch.zeros(1, 0, dtype=torch.long, device=device)

    def pick_sub(_group: int, logits: torch.Tensor) -> torch.Tensor:
        return choose(logits, sampling.code_predictor, generator)

    for step in range(max_frames):
        logits = process_talker_logits(talker.codec_head(hidden), previous, step, sampling.repetition_penalty,
                                       suppressed, cfg.codec_eos_token_id)
        code0 = choose(logits, sampling.talker, generator)
        if code0.item() == cfg.codec_eos_token_id:
            return
        rest = talker.code_predictor.predict(hidden, talker.codec_embed(code0), pick_sub)
        frame = torch.cat((code0[:, None], rest), dim=1)
        yield frame[0]
        previous = torch.cat((previous, code0[:, None]), dim=1)
        if step + 1 < max_frames:
            step_input = talker.frame_embed(frame) + prompt.text_track(step)
            hidden = talker.model(step_input[:, None], cache)[:, -1]
