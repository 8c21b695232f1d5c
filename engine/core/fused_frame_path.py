"""The engine's fast frame path: the arithmetic of `frame_path.TorchFramePath` with merged projections and Triton
kernels (`fused_layers`, `kernels/sampling`): ~1,170 launches per frame instead of ~6,500, which is what a graph
replay costs on the GPU. Prefill is one varlen pass over the prompts' tokens, padded to a bucket and replayed as a
CUDA graph where the runner pads its steps (`prefill_graphs`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.core.fused_layers import PREDICTOR_FEW_ROWS, TALKER_FEW_ROWS, FusedLayers
from engine.core.kv_cache import SlotKVCache
from engine.core.prefill_graphs import PREFILL_BUCKETS, PaddedPrefill
from engine.kernels.sampling import fused_choose
from engine.model.talker import Talker
from engine.reference import BatchSampling
from engine.sampling import process_talker_logits


class FusedFramePath:
    def __init__(self, talker: Talker, cache: SlotKVCache, rows: int, pad_prefill: bool = False,
                 capture: bool = False) -> None:
        """`rows`: the largest batch a step will run (the code predictor keeps a 16-position cache per row);
        `pad_prefill`: pad prefills to token buckets, their padding in the cache's scratch slot (the one past its
        slots); `capture`: replay the padded prefills as CUDA graphs."""
        self.talker, self.cache = talker, cache
        self.talker_layers = FusedLayers(talker.model, TALKER_FEW_ROWS)
        self.prefill = PaddedPrefill(self._prefill_tokens, talker.cfg.layers.hidden_size, cache.k.dtype,
                                     cache.k.device, cache.shape.slots, cache.shape.capacity,
                                     PREFILL_BUCKETS if pad_prefill else (), capture)
        predictor = talker.code_predictor
        self.predictor_layers = FusedLayers(predictor.model, PREDICTOR_FEW_ROWS)
        # Every code's input to the code predictor (its embedding, projected to the predictor's width) computed once:
        # a sub-step looks its row up, one launch where an embedding and a matmul were two. The last code's table
        # feeds no sub-step (only the talker's next input, in its own width): it is left out.
        with torch.no_grad():
            self.projected_codes = [predictor.small_to_mtp_projection(table.weight)
                                    for table in predictor.model.codec_embedding[:-1]]
        layers = predictor.cfg.layers
        device, dtype = cache.k.device, cache.k.dtype
        shape = (layers.num_hidden_layers, rows, layers.num_key_value_heads, predictor.cfg.num_code_groups,
                 layers.head_dim)
        self.predictor_k = torch.zeros(shape, dtype=dtype, device=device)
        self.predictor_v = torch.zeros(shape, dtype=dtype, device=device)
        # Index tensors sliced per batch size, so a step builds none on the fly.
        self.rows = torch.arange(rows, device=device)
        self.pair_rows = self.rows.repeat_interleave(2)
        self.pair_positions = torch.arange(2, device=device).repeat(rows)
        self.group_positions = torch.arange(predictor.cfg.num_code_groups, device=device)[:, None].repeat(1, rows)

    def _prefill_tokens(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The prompts' tokens as rows of one varlen pass: each row attends within its own slot."""
        return self.talker_layers(x, positions, slots, self.cache.k, self.cache.v)

    def sample(self, hidden: torch.Tensor, seen: torch.Tensor, frame_index: torch.Tensor, sampling: BatchSampling,
               suppressed: torch.Tensor) -> torch.Tensor:
        talker = self.talker
        cfg = talker.cfg
        logits = process_talker_logits(talker.codec_head(hidden), seen, frame_index, sampling.min_frames,
                                       sampling.penalty, suppressed, cfg.codec_eos_token_id)
        code = fused_choose(logits, sampling.talker, sampling.seeds, frame_index, 0, cfg.num_code_groups)
        predictor = talker.code_predictor
        batch = hidden.shape[0]
        # The predictor's prefill: (talker hidden, code 0) at positions 0 and 1 of each row's cache.
        pair = predictor.small_to_mtp_projection(torch.stack((hidden, talker.codec_embed(code)), dim=1))
        logits = self._predictor(pair.reshape(2 * batch, -1), self.pair_positions[: 2 * batch],
                                 self.pair_rows[: 2 * batch], 0).view(batch, 2, -1)[:, 1]
        codes = [code]
        for group in range(cfg.num_code_groups - 1):
            code = fused_choose(logits, sampling.code_predictor, sampling.seeds, frame_index, group + 1,
                                cfg.num_code_groups)
            codes.append(code)
            if group + 2 < cfg.num_code_groups:
                embed = F.embedding(code, self.projected_codes[group])
                logits = self._predictor(embed, self.group_positions[group + 2, :batch], self.rows[:batch], group + 1)
        return torch.stack(codes, dim=1)

    def _predictor(self, x: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, group: int) -> torch.Tensor:
        """The code predictor's pass over x -> the logits of code `group` + 1 (its head `group`)."""
        return self.predictor_layers(x, positions, rows, self.predictor_k, self.predictor_v,
                                     self.talker.code_predictor.lm_head[group].weight)

    def advance(self, step_input: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.talker_layers(step_input, positions, slots, self.cache.k, self.cache.v)
