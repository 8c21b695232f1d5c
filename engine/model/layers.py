"""Qwen3 transformer building blocks shared by the talker and the code predictor (in this repository "decoder"
means only the codec decoder).

The math follows the reference exactly (fp32 RMSNorm, rotate-half RoPE with fp32 angles, q/k RMSNorm per head,
SwiGLU) so that greedy decoding reproduces its codes frame for frame.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import TransformerConfig


class Derived:
    """A tensor made from a module's weights (a codebook's vectors, merged projections), made once and again only
    when the weights change: moved, cast, replaced or loaded into (their device, dtype, storage and version; an
    inference tensor keeps no version, and can be written only inside inference mode, which loading is not). What
    the reference recomputes on every call costs nothing per call then; a decode call makes it before any CUDA graph
    is captured, so a capture only reads it. `make` is a function of the weights alone (it never reads a module): a
    copied module then derives from its own weights, not from those of the module it was copied from."""

    def __init__(self, make: Callable[..., torch.Tensor]) -> None:
        self.make = make
        self._key: tuple | None = None
        self._value: torch.Tensor | None = None

    def __call__(self, *weights: torch.Tensor) -> torch.Tensor:
        key = tuple((w.device, w.dtype, w.data_ptr(), None if w.is_inference() else w._version) for w in weights)
        if key != self._key:
            self._key, self._value = key, self.make(*weights)
        return self._value


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """weight * (normalised in fp32, cast back), exactly as the reference rounds; `F.rms_norm` does the
        normalisation in one kernel where the backend has one."""
        normalised = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normalised.to(x.dtype)


class LayerScale(nn.Module):
    """A learnt per-channel scale on a residual branch (the codec transformers use it)."""

    def __init__(self, channels: int, initial: float = 1.0) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((channels,), initial))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class RotaryEmbedding(nn.Module):
    """1-D RoPE. The talker's "mRoPE" is exactly this: its three position ids are always equal."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def inv_freq(self, device: torch.device | str) -> torch.Tensor:
        """[head_dim / 2] fp32 angular frequencies."""
        exponent = torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim
        return 1.0 / (self.theta ** exponent)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, T, head_dim].

        The frequencies are rebuilt in fp32 on every call rather than kept as a buffer, so casting the model to
        bf16 can never round them."""
        freqs = positions.float()[..., None] * self.inv_freq(positions.device)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B, Hkv * groups, T, D] by broadcasting, with no index tensor built on the fly (as
    repeat_interleave does), so it is the same plain kernels on every backend and inside CUDA graphs."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """SDPA for grouped-query attention: q [B, Hq, T, D], k/v [B, Hkv, S, D]."""
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), **kwargs)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [B, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(q [B, Hq, T, D], k, v [B, Hkv, T, D]) -> [B, Hq, T, D]: stores the new keys/values wherever the caller keeps its
cache and attends over what each query may see. The model code is the same for every cache layout."""


@dataclass
class LayerKV:
    """One layer's keys and values for one sequence batch, grown by concatenation (the simple reference path)."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Causal masking is only needed when the new tokens are the whole sequence (a prefill from empty);
        # a single new token may see everything before it.
        if q.shape[2] > 1 and self.k is not None:
            raise ValueError("multi-token extension of a non-empty cache is not supported on this path")
        causal = q.shape[2] > 1
        self.k = k if self.k is None else torch.cat((self.k, k), dim=2)
        self.v = v if self.v is None else torch.cat((self.v, v), dim=2)
        return gqa_attention(q, self.k, self.v, is_causal=causal)

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]


@dataclass
class KVCache:
    layers: list[LayerKV] = field(default_factory=list)

    @classmethod
    def empty(cls, num_layers: int) -> "KVCache":
        return cls([LayerKV() for _ in range(num_layers)])

    @property
    def length(self) -> int:
        return self.layers[0].length

    def positions(self, batch: int, new: int, device: torch.device) -> torch.Tensor:
        return torch.arange(self.length, self.length + new, device=device).expand(batch, new)

    def attends(self) -> list[Attend]:
        return [layer.attend for layer in self.layers]


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class TransformerStack(nn.Module):
    """Layers + final norm over input embeddings; parameter names match the checkpoint's `*.model.*` prefix."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, attends: list[Attend]) -> torch.Tensor:
        """embeds [B, T, H] at positions [B, T]; `attends[i]` serves layer i's cache. Post-norm hidden states."""
        cos, sin = self.rotary(positions, embeds.dtype)
        x = embeds
        for layer, attend in zip(self.layers, attends):
            x = layer(x, cos, sin, attend)
        return self.norm(x)

    def extend(self, embeds: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The simple path: append embeds [B, T, H] to a concatenating cache."""
        positions = cache.positions(embeds.shape[0], embeds.shape[1], embeds.device)
        return self(embeds, positions, cache.attends())
