"""A TransformerStack's forward for the engine (the talker's and the code predictor's transformer blocks): merged
projections and fused Triton kernels over a slot cache.

Per block: RMSNorm (fused with the previous residual add), one QKV matmul, one kernel for q/k norm + RoPE + the
cache write, varlen attention, the output matmul, add + RMSNorm, one gate/up matmul, SwiGLU, the down matmul:
9 launches instead of ~45. A pass of a few rows takes `few_rows_linear` instead, which folds the norms, SwiGLU and
residual adds into its matmuls: 6 launches. The merged weights are the module's own storage (its q/k/v and gate/up
parameters become views into them), so the simple path keeps working on the same memory.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.attention import varlen_attention
from engine.kernels.few_rows_linear import few_rows_linear
from engine.kernels.layer_ops import add_rms_norm, qk_norm_rope_store, silu_mul
from engine.model.layers import TransformerBlock, TransformerStack


def merge_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for linears that read the same input; each linear's parameters become views of it."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([linear.bias.detach() for linear in linears]) if has_bias else None
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = nn.Parameter(weight[start:start + rows], requires_grad=False)
        if has_bias:
            linear.bias = nn.Parameter(bias[start:start + rows], requires_grad=False)
        start += rows
    return weight, bias


# Rows up to which a pass takes `few_rows_linear` (one program a row and 8 features, each weight tile read once per
# row) instead of cuBLAS and the separate kernels. At two rows it was faster for the code predictor's blocks (28.5
# against 32.1 us) and slower for the talker's (56.8 against 54.9 us), H100 (docs/benchmarks.md).
TALKER_FEW_ROWS = 1
PREDICTOR_FEW_ROWS = 2


class _MergedBlock:
    def __init__(self, layer: TransformerBlock) -> None:
        attention = layer.self_attn
        self.layer = layer
        self.qkv, self.qkv_bias = merge_linears(attention.q_proj, attention.k_proj, attention.v_proj)
        self.gate_up, _ = merge_linears(layer.mlp.gate_proj, layer.mlp.up_proj)


class FusedLayers:
    def __init__(self, stack: TransformerStack, few_rows: int) -> None:
        """`few_rows`: passes of at most this many rows take `few_rows_linear`."""
        self.stack, self.few_rows = stack, few_rows
        self.layers = [_MergedBlock(layer) for layer in stack.layers]
        first = stack.layers[0].self_attn
        self.q_heads, self.head_dim = first.num_heads, first.head_dim
        self.eps = stack.norm.eps
        self.inv_freq = stack.rotary.inv_freq(stack.norm.weight.device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, head: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, H] (consumed: it becomes the residual), one token per row at positions [N] of cache slots
        [N]; caches [layers, slots, Hkv, capacity, D]. Returns the final-normed hidden states [N, H], or with `head`
        [V, H] (an output layer without bias) their logits [N, V]: for a few rows the final norm is then folded into
        the head's matmul, a launch less.

        Several rows may share a slot (a prefill): every row's key is stored before any row attends, and each row
        sees its slot's positions up to its own."""
        lengths = positions + 1
        if x.shape[0] <= self.few_rows:
            self._few_rows(x, positions, slots, lengths, k_cache, v_cache)
            if head is not None:
                return few_rows_linear(x, head, norm=self.stack.norm.weight, eps=self.eps)
            return add_rms_norm(x, None, self.stack.norm.weight, self.eps)
        norms = [merged.layer.input_layernorm.weight for merged in self.layers[1:]] + [self.stack.norm.weight]
        normed = add_rms_norm(x, None, self.layers[0].layer.input_layernorm.weight, self.eps)
        for index, (merged, next_norm) in enumerate(zip(self.layers, norms)):
            layer = merged.layer
            attended = self._attend(index, F.linear(normed, merged.qkv, merged.qkv_bias), positions, slots, lengths,
                                    k_cache, v_cache)
            normed = add_rms_norm(x, layer.self_attn.o_proj(attended), layer.post_attention_layernorm.weight,
                                  self.eps)
            normed = add_rms_norm(x, layer.mlp.down_proj(silu_mul(F.linear(normed, merged.gate_up))), next_norm,
                                  self.eps)
        return normed if head is None else F.linear(normed, head)

    def _few_rows(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """A few tokens (a lone request's step; the code predictor's sub-steps and prefill at low load) through the
        blocks, x the residual stream: the norms, SwiGLU and residual adds fused into the matmuls
        (`few_rows_linear`), 6 launches a block instead of 9: at one row 29% less time in the code predictor's
        blocks, 14% in the talker's (docs/benchmarks.md). Each row's bits are its own, whatever the other rows."""
        for index, merged in enumerate(self.layers):
            layer = merged.layer
            qkv = few_rows_linear(x, merged.qkv, merged.qkv_bias, norm=layer.input_layernorm.weight, eps=self.eps)
            attended = self._attend(index, qkv, positions, slots, lengths, k_cache, v_cache)
            o_proj = layer.self_attn.o_proj
            few_rows_linear(attended, o_proj.weight, o_proj.bias, residual=x)
            gate_up = few_rows_linear(x, merged.gate_up, norm=layer.post_attention_layernorm.weight, eps=self.eps)
            down = layer.mlp.down_proj
            few_rows_linear(gate_up, down.weight, down.bias, swiglu=True, residual=x)

    def _attend(self, index: int, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                lengths: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Layer `index`'s attention from its merged q/k/v projection [N, (Hq + 2 Hkv) * D] -> [N, Hq * D]."""
        attention = self.layers[index].layer.self_attn
        queries = qk_norm_rope_store(qkv, attention.q_norm.weight, attention.k_norm.weight, self.inv_freq, positions,
                                     slots, k_cache[index], v_cache[index], self.q_heads, self.eps)
        return varlen_attention(queries, k_cache[index], v_cache[index], slots, lengths).view(qkv.shape[0], -1)
