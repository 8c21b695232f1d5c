"""The code predictor: from the talker's hidden state and code 0, predicts codebooks 1..15 of a frame.

Every frame starts from an empty 16-slot cache: a 2-token prefill (talker hidden, embedding of code 0), then one
step per further codebook, each with its own input table and output head.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.config import CodePredictorConfig
from engine.model.layers import KVCache, TransformerStack


class CodePredictorBackbone(TransformerStack):
    def __init__(self, cfg: CodePredictorConfig, talker_hidden: int) -> None:
        super().__init__(cfg.layers)
        # Inputs live in the talker's width; `small_to_mtp_projection` maps them when the widths differ.
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, talker_hidden) for _ in range(cfg.num_code_groups - 1)
        )


class CodePredictor(nn.Module):
    def __init__(self, cfg: CodePredictorConfig, talker_hidden: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = CodePredictorBackbone(cfg, talker_hidden)
        hidden = cfg.layers.hidden_size
        self.lm_head = nn.ModuleList(
            nn.Linear(hidden, cfg.vocab_size, bias=False) for _ in range(cfg.num_code_groups - 1)
        )
        self.small_to_mtp_projection: nn.Module = (
            nn.Linear(talker_hidden, hidden, bias=True) if hidden != talker_hidden else nn.Identity()
        )

    def predict(self, talker_hidden: torch.Tensor, code0_embed: torch.Tensor,
                pick: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """talker_hidden, code0_embed [B, H_talker] -> codes 1..15 as [B, 15].

        `pick(group, logits [B, V]) -> ids [B]` chooses each code (greedy or sampled by the caller)."""
        cache = KVCache.empty(len(self.model.layers))
        x = torch.stack((talker_hidden, code0_embed), dim=1)
        codes = []
        for group in range(self.cfg.num_code_groups - 1):
            hidden = self.model.extend(self.small_to_mtp_projection(x), cache)
            code = pick(group, self.lm_head[group](hidden[:, -1]))
            codes.append(code)
            x = self.model.codec_embedding[group](code)[:, None]
        return torch.stack(codes, dim=1)
