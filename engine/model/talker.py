"""The talker: a Qwen3 transformer over summed text-track and codec-track embeddings that predicts codebook 0."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import TalkerConfig
from engine.model.code_predictor import CodePredictor
from engine.model.layers import TransformerStack


class TalkerBackbone(TransformerStack):
    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__(cfg.layers)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.layers.hidden_size)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)


class TextProjection(nn.Module):
    def __init__(self, text_hidden: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = nn.Linear(text_hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class Talker(nn.Module):
    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = TalkerBackbone(cfg)
        self.text_projection = TextProjection(cfg.text_hidden_size, cfg.layers.hidden_size)
        self.codec_head = nn.Linear(cfg.layers.hidden_size, cfg.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg.code_predictor, cfg.layers.hidden_size)

    def text_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Text-track vectors T(ids): [...] -> [..., H]."""
        return self.text_projection(self.model.text_embedding(ids))

    def codec_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Codec-track vectors C(ids) for codebook-0 codes and control ids."""
        return self.model.codec_embedding(ids)

    def frame_embed(self, frame: torch.Tensor) -> torch.Tensor:
        """The codec-track vector of a whole frame [..., 16]: sum of all 16 code embeddings.

        Stacked then summed in one reduction, as the reference does, so fp32 rounding matches it."""
        tables = [self.model.codec_embedding, *self.code_predictor.model.codec_embedding]
        return torch.stack([table(frame[..., i]) for i, table in enumerate(tables)], dim=-2).sum(-2)
