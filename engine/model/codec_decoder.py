"""The 12 Hz codec decoder (codes -> 24 kHz waveform) as an exact streaming decoder.

The decoder is strictly causal, so its streaming decode is exact: every causal convolution keeps the last inputs it
needs, each transposed convolution keeps its last input frame, and each transformer layer keeps the keys and values of
its sliding window. The offline decode is the streaming decode of all frames at once from an empty state: there is
one code path, and streaming in any piece size reproduces it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import CodecDecoderConfig
from engine.model.layers import MLP, Derived, LayerScale, RMSNorm, RotaryEmbedding, apply_rope, repeat_kv


@dataclass
class DecoderState:
    """Everything a streaming decode carries between calls; batch is dim 0 of every tensor.

    A call replaces the history and window tensors with the ones it leaves, unless `next` is given: then it writes
    them into `next`'s tensors (the decoder pool's packed rows, `engine/core/codec_decoding.py`), and this state is
    only read."""

    position: torch.Tensor  # [B] frames decoded so far
    history: dict[str, torch.Tensor] = field(default_factory=dict)  # causal conv / transposed conv inputs
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [B, H, window, D]
    values: list[torch.Tensor] = field(default_factory=list)
    next: DecoderState | None = None

    def window_out(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Where the call writes layer `layer`'s keys and values; (None, None): it replaces them (`keep_window`)."""
        return (None, None) if self.next is None else (self.next.keys[layer], self.next.values[layer])

    def keep_window(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.next is None:
            self.keys[layer], self.values[layer] = keys, values
        elif keys is not self.next.keys[layer]:
            self.next.keys[layer].copy_(keys)
            self.next.values[layer].copy_(values)


class CausalConv(nn.Module):
    """Conv1d left-padded by its receptive field; in streaming it remembers the inputs the padding stood for."""

    def __init__(self, key: str, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.key = key
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.context = (kernel - 1) * dilation
        self.fast_path = False  # `CodecDecoder.use_fast_path`
        self._weight_4d = Derived(_channels_last_4d)

    def forward(self, x: torch.Tensor, state: DecoderState, activation: SnakeBeta | None = None,
                input_bias: torch.Tensor | None = None, add_bias: bool = True) -> torch.Tensor:
        """`activation`, if given, is applied to x first (fused with the padding on a GPU), after `input_bias` (the
        bias that the convolution which made x left out); `add_bias=False` leaves this convolution's own out."""
        x = remembered_padded(x, state, self.key, self.context, activation, self.fast_path, input_bias)
        conv = self.conv
        bias = conv.bias if add_bias else None
        if not self.fast_path:
            return F.conv1d(x, conv.weight, bias, dilation=conv.dilation, groups=conv.groups)
        return F.conv2d(x.unsqueeze(2), self._weight_4d(conv.weight), bias, dilation=(1, conv.dilation[0]),
                        groups=conv.groups).squeeze(2)


class CausalTransposedConv(nn.Module):
    """ConvTranspose1d (kernel 2s or s, stride s) trimmed on the right, so output t*s.. depends on inputs <= t."""

    def __init__(self, key: str, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.key = key
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.stride = stride
        self.overlap = kernel // stride - 1  # previous input frames that still reach the new outputs
        self.fast_path = False  # `CodecDecoder.use_fast_path`
        self._weight_4d = Derived(_channels_last_4d)

    def forward(self, x: torch.Tensor, state: DecoderState, activation: SnakeBeta | None = None) -> torch.Tensor:
        """`activation`, if given, is applied to x first (fused with the padding on a GPU)."""
        n = x.shape[-1]
        # A zero past input contributes nothing; the bias is added once per output either way.
        x = remembered_padded(x, state, self.key, self.overlap, activation, self.fast_path)
        start = self.overlap * self.stride
        return self._convolve(x)[..., start: start + n * self.stride]

    def _convolve(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fast_path:
            return self.conv(x)
        return F.conv_transpose2d(x.unsqueeze(2), self._weight_4d(self.conv.weight), self.conv.bias,
                                  stride=(1, self.stride)).squeeze(2)


def _channels_last_4d(weight: torch.Tensor) -> torch.Tensor:
    """A 1-D convolution's weight [out, in, kernel] as a 2-D one of height 1, channels-last: with its input in the
    same layout, cuDNN runs the convolution without converting either (`CodecDecoder.use_fast_path`)."""
    return weight.unsqueeze(2).contiguous(memory_format=torch.channels_last)


class SnakeBeta(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = torch.exp(self.alpha)[None, :, None]
        beta = torch.exp(self.beta)[None, :, None]
        return x + (1.0 / (beta + 1e-9)) * torch.pow(torch.sin(x * alpha), 2)


def padded(x: torch.Tensor, past: torch.Tensor | None, context: int, activation: SnakeBeta | None,
           channels_minor: bool, bias: torch.Tensor | None = None, tail: torch.Tensor | None = None) -> torch.Tensor:
    """A causal convolution's input: cat(past, activation(x + bias)) along time, zeros for a missing past; its last
    `context` columns copied into `tail` too, if given. On a GPU the bias, the activation, the padding and the copy
    are one Triton kernel (`engine/kernels/conv_elementwise.py`), the decoder's largest saving, which also writes the
    layout the convolution reads (`channels_minor`)."""
    if x.is_cuda and (activation is not None or context or bias is not None):
        from engine.kernels.conv_elementwise import snake_padded  # imported here: Triton only where it runs
        alpha, beta = (None, None) if activation is None else (activation.alpha, activation.beta)
        return snake_padded(x, alpha, beta, past, context, channels_minor, bias, tail)
    if bias is not None:
        x = x + bias[:, None]
    if activation is not None:
        x = activation(x)
    if context == 0:
        return x
    if past is None:
        past = x.new_zeros(x.shape[0], x.shape[1], context)
    x = torch.cat((past, x), dim=-1)
    if tail is not None:
        tail.copy_(x[..., -context:])
    return x


def remembered_padded(x: torch.Tensor, state: DecoderState, key: str, context: int, activation: SnakeBeta | None,
                      channels_minor: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`padded` with history `key`'s past read from `state` and the next call's past left behind: written into
    `state.next` by the padding itself where the decoder pool gave one, else kept as a view of the result."""
    if not context:
        return padded(x, None, 0, activation, channels_minor, bias)
    tail = None if state.next is None else state.next.history[key]
    x = padded(x, state.history.get(key), context, activation, channels_minor, bias, tail)
    if tail is None:
        state.history[key] = x[..., -context:]
    return x


def bias_residual(residual: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """residual + (x + bias): one Triton kernel on a GPU, where PyTorch's broadcast bias add is a slow one."""
    if x.is_cuda:
        from engine.kernels.conv_elementwise import add_bias_residual
        return add_bias_residual(residual, x, bias)
    return residual + (x + bias[:, None])


class ConvNeXtBlock(nn.Module):
    def __init__(self, key: str, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv(key, dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        h = self.dwconv(x, state).permute(0, 2, 1)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).permute(0, 2, 1)


class ResidualUnit(nn.Module):
    def __init__(self, key: str, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(key, dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(key + ".pw", dim, dim, 1)

    def forward(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        if not self.conv1.fast_path:
            return x + self.conv2(self.conv1(x, state, self.act1), state, self.act2)
        # each convolution's bias goes to the kernel after it: one pass over the activation fewer each
        hidden = self.conv1(x, state, self.act1, add_bias=False)
        if x.is_cuda:
            from engine.kernels.conv_elementwise import pointwise_fits  # Triton only where it runs
            if pointwise_fits(x.shape[1]):
                return self.fused_tail(x, hidden)
        out = self.conv2(hidden, state, self.act2, input_bias=self.conv1.conv.bias, add_bias=False)
        return bias_residual(x, out, self.conv2.conv.bias)

    def fused_tail(self, x: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """x + conv2(act2(hidden + conv1's bias)), conv2 being 1x1: one Triton matrix product that applies the bias
        and SnakeBeta as it loads and adds conv2's bias and the residual as it stores (three passes over the
        activation instead of seven; `engine/kernels/conv_elementwise.py`). For the last block's 96 channels, where
        it is faster than cuDNN and the separate kernels; wider units keep those."""
        from engine.kernels.conv_elementwise import snake_pointwise_residual  # Triton only where it runs
        return snake_pointwise_residual(x, hidden, self.act2.alpha, self.act2.beta, self.conv1.conv.bias,
                                        self.conv2.conv.weight, self.conv2.conv.bias)


class UpsampleBlock(nn.Module):
    """SnakeBeta -> causal transposed conv (x rate) -> residual units with dilations 1, 3, 9."""

    def __init__(self, key: str, cin: int, cout: int, rate: int) -> None:
        super().__init__()
        self.block = nn.ModuleList([
            SnakeBeta(cin),
            CausalTransposedConv(key + ".up", cin, cout, 2 * rate, rate),
            *(ResidualUnit(f"{key}.res{d}", cout, d) for d in (1, 3, 9)),
        ])

    def forward(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        x = self.block[1](x, state, self.block[0])
        for layer in self.block[2:]:
            x = layer(x, state)
        return x


class WindowAttention(nn.Module):
    """Causal attention over the last `window` frames (keys j with i - window < j <= i)."""

    def __init__(self, cfg: CodecDecoderConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.window = cfg.sliding_window
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        self._qkv_weight = Derived(lambda *weights: torch.cat(weights))
        self._qkv_bias = Derived(lambda *biases: torch.cat(biases)) if bias else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hidden: torch.Tensor | None,
                state: DecoderState, layer: int) -> torch.Tensor:
        """`hidden`: the keys each query may not see (`window_mask`), the same for every layer; None on a GPU's
        fast path (`PreTransformer.fused`), where one kernel does RoPE, the window's shift and the attention
        (`engine/kernels/window_attention.py`) with the same arithmetic."""
        b, n, _ = x.shape
        qkv = F.linear(x, *self._qkv())
        if hidden is None:
            from engine.kernels.window_attention import window_attention  # imported here: Triton only where it runs
            out, keys, values = window_attention(qkv, cos, sin, state.keys[layer], state.values[layer],
                                                 state.position, self.heads, *state.window_out(layer))
            state.keep_window(layer, keys, values)
            return self.o_proj(out)
        heads = qkv.unflatten(-1, (self.heads + 2 * self.kv_heads, self.head_dim)).transpose(1, 2)
        # q and k rotate as one tensor: the same elementwise ops, half the launches
        q, k = apply_rope(heads[:, : self.heads + self.kv_heads], cos, sin).split((self.heads, self.kv_heads), 1)
        v = heads[:, self.heads + self.kv_heads:]
        keys = torch.cat((state.keys[layer], k), dim=2)
        values = torch.cat((state.values[layer], v), dim=2)
        state.keep_window(layer, keys[:, :, -self.window:], values[:, :, -self.window:])
        out = self._attend(q, keys, values, hidden)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))

    def _projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.q_proj, self.k_proj, self.v_proj

    def _qkv(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q, k and v's weights (and biases) as one [(Hq + 2 Hkv) D, hidden] matrix: one product for the three."""
        projections = self._projections()
        weight = self._qkv_weight(*(p.weight for p in projections))
        return weight, None if self._qkv_bias is None else self._qkv_bias(*(p.bias for p in projections))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor
                ) -> torch.Tensor:
        """Plain masked softmax attention: a window of 72 keys is too small for fused kernels to matter, and
        their mask and shape constraints vary by backend. The softmax upcasts as it reads (one kernel, the same
        arithmetic as `.float().softmax()`)."""
        group = self.heads // self.kv_heads
        keys, values = repeat_kv(keys, group), repeat_kv(values, group)
        scores = (q @ keys.transpose(-1, -2)) * self.head_dim ** -0.5
        weights = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        return weights @ values


def window_mask(position: torch.Tensor, n: int, window: int) -> torch.Tensor:
    """[B, 1, n, window + n] boolean, True where a query may NOT look: cached slot s holds frame
    position - window + s, the n new frames follow; a query sees the `window` frames up to its own. Built once per
    decode call (a dozen small kernels), not once per layer."""
    key_pos = position[:, None] - window + torch.arange(window + n, device=position.device)[None]
    query_pos = position[:, None] + torch.arange(n, device=position.device)[None]
    rel = query_pos[:, :, None] - key_pos[:, None, :]
    hidden = (rel < 0) | (rel >= window) | (key_pos[:, None, :] < 0)
    return hidden[:, None]


class GateUpMLP(MLP):
    """SwiGLU with gate and up as one matrix product. (The talker's simple path keeps two: its codes are compared bit
    for bit with the reference's, and a merged product may round differently on some backends; the decoder's audio
    is compared within 1e-4.)"""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__(hidden, intermediate)
        self._gate_up = Derived(lambda gate, up: torch.cat((gate, up)))

    def gate_up_weight(self) -> torch.Tensor:
        return self._gate_up(self.gate_proj.weight, self.up_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_weight()).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class TransformerLayer(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig) -> None:
        super().__init__()
        self.self_attn = WindowAttention(cfg)
        self.mlp = GateUpMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)

    def forward(self, x, cos, sin, hidden, state: DecoderState, layer: int) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, hidden, state, layer)
        x = x + self.self_attn_layer_scale(attn)
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig) -> None:
        super().__init__()
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.window = cfg.sliding_window
        self.fast_path = False  # `CodecDecoder.use_fast_path`: the attention's kernel on a GPU

    def forward(self, x: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """x [B, n, latent] for frames state.position .. + n."""
        n = x.shape[1]
        positions = state.position[:, None] + torch.arange(n, device=x.device)[None]
        x = self.input_proj(x)
        cos, sin = self.rotary(positions, x.dtype)
        if self.fast_path and x.is_cuda:
            return self.fused(x, cos, sin, state)
        hidden = window_mask(state.position, n, self.window)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, hidden, state, i)
        return self.output_proj(self.norm(x))

    def fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """The layers on a GPU's fast path, the same arithmetic in fewer launches: each LayerScale, residual add and
        the RMSNorm after it in one kernel (six PyTorch ops before), SwiGLU in one, the attention in one
        (`WindowAttention.forward`). x [B, n, hidden], consumed (it is the residual)."""
        from engine.kernels.layer_ops import add_rms_norm, silu_mul  # imported here: Triton only where it runs
        b, n, size = x.shape
        residual = x.reshape(b * n, size)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        first = self.layers[0].input_layernorm
        normed = add_rms_norm(residual, None, first.weight, first.eps)
        for i, (layer, next_norm) in enumerate(zip(self.layers, norms)):
            attended = layer.self_attn(normed.view(b, n, size), cos, sin, None, state, i)
            post = layer.post_attention_layernorm
            normed = add_rms_norm(residual, attended.reshape(b * n, size), post.weight, post.eps,
                                  layer.self_attn_layer_scale.scale)
            mlp = layer.mlp
            down = mlp.down_proj(silu_mul(F.linear(normed, mlp.gate_up_weight())))
            normed = add_rms_norm(residual, down, next_norm.weight, next_norm.eps, layer.mlp_layer_scale.scale)
        return self.output_proj(normed.view(b, n, size))


class Codebook(nn.Module):
    """EMA codebook as stored: vectors are embedding_sum / cluster_usage."""

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))
        self._vectors = Derived(lambda total, usage: total / usage.clamp(min=1e-5)[:, None])

    def vectors(self) -> torch.Tensor:
        """embedding_sum / usage, as the reference divides them: made once (`Derived`), not in every decode call."""
        return self._vectors(self.embedding_sum, self.cluster_usage)


class VQLayer(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self._codebook = Codebook(size, dim)


class VQStack(nn.Module):
    def __init__(self, books: int, size: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VQLayer(size, dim) for _ in range(books))


class ResidualQuantizer(nn.Module):
    """Decode side of an RVQ group: sum of codebook vectors, then a 1x1 projection."""

    def __init__(self, books: int, size: int, dim: int, out_dim: int) -> None:
        super().__init__()
        self.vq = VQStack(books, size, dim)
        self.output_proj = nn.Conv1d(dim, out_dim, 1, bias=False)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, books, n] -> [B, out_dim, n]."""
        total = torch.zeros((), device=codes.device)
        for book, layer in zip(codes.unbind(1), self.vq.layers):
            total = total + F.embedding(book, layer._codebook.vectors()).transpose(1, 2)
        return self.output_proj(total)


class SplitQuantizer(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig) -> None:
        super().__init__()
        dim = cfg.codebook_dim // 2
        self.rvq_first = ResidualQuantizer(1, cfg.codebook_size, dim, cfg.codebook_dim)
        self.rvq_rest = ResidualQuantizer(cfg.num_quantizers - 1, cfg.codebook_size, dim, cfg.codebook_dim)
        self.fast_path = False  # `CodecDecoder.use_fast_path`: every lookup and sum in one kernel on a GPU
        self._books = Derived(lambda *vectors: torch.stack(vectors))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, n, Q] (negative codes read as 0) -> [B, codebook_dim, n]."""
        if self.fast_path and codes.is_cuda:
            return self.fused_decode(codes)
        codes = codes.clamp(min=0).transpose(1, 2)
        return self.rvq_first.decode(codes[:, :1]) + self.rvq_rest.decode(codes[:, 1:])

    def fused_decode(self, codes: torch.Tensor) -> torch.Tensor:
        """`decode` with every lookup and sum in one Triton kernel: the same bits where bf16 rounds to nearest."""
        from engine.kernels.codebooks import codebook_sums  # imported here: Triton only where it runs
        layers = [*self.rvq_first.vq.layers, *self.rvq_rest.vq.layers]
        books = self._books(*(layer._codebook.vectors() for layer in layers))
        first, rest = codebook_sums(codes, books, len(self.rvq_first.vq.layers))
        return self.rvq_first.output_proj(first) + self.rvq_rest.output_proj(rest)


class CodecDecoder(nn.Module):
    """Parameter names match `speech_tokenizer/model.safetensors` under the `decoder.` prefix."""

    def __init__(self, cfg: CodecDecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.quantizer = SplitQuantizer(cfg)
        self.pre_conv = CausalConv("pre_conv", cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = PreTransformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransposedConv(f"up{i}", cfg.latent_dim, cfg.latent_dim, r, r),
                           ConvNeXtBlock(f"up{i}.convnext", cfg.latent_dim)])
            for i, r in enumerate(cfg.upsampling_ratios)
        )
        channels = [cfg.decoder_dim // 2 ** i for i in range(len(cfg.upsample_rates) + 1)]
        self.decoder = nn.ModuleList([
            CausalConv("conv_in", cfg.latent_dim, cfg.decoder_dim, 7),
            *(UpsampleBlock(f"block{i}", channels[i], channels[i + 1], r) for i, r in enumerate(cfg.upsample_rates)),
            SnakeBeta(channels[-1]),
            CausalConv("conv_out", channels[-1], 1, 7),
        ])

    @property
    def samples_per_frame(self) -> int:
        return self.cfg.samples_per_frame

    def use_fast_path(self, on: bool = True) -> None:
        """The GPU's way to run the convolutions: on activations stored channels-minor ([B, C, T] in the memory of
        [B, T, C]) as 2-D convolutions of height 1 on channels-last weights, which cuDNN runs without converting
        layouts, and with each residual unit's biases added by the kernels after its convolutions (together 1.47x
        for the whole decoder at 256 x 4 frames on an H100, docs/benchmarks.md). The transformer's output is in that
        layout already, and the padding kernel writes it. A grouped convolution (ConvNeXt's depthwise one, on few
        columns) stays as it is: cuDNN's channels-last kernels for it are slow. Only for calls whose convolution
        algorithms were timed (the decoder pool's CUDA graphs): cuDNN's untimed picks in this layout are slower than
        the plain path. The arithmetic is the plain path's: the tests check it on the CPU. The transformer's window
        attention runs as one kernel per layer (`engine/kernels/window_attention.py`), and a frame's codebook lookups
        and sums as one (`engine/kernels/codebooks.py`)."""
        for module in self.modules():
            if isinstance(module, (CausalConv, CausalTransposedConv)):
                module.fast_path = on and module.conv.groups == 1
        self.pre_transformer.fast_path = on
        self.quantizer.fast_path = on

    def new_state(self, batch: int = 1, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> DecoderState:
        cfg = self.cfg
        shape = (batch, cfg.num_key_value_heads, cfg.sliding_window, cfg.head_dim)
        layers = range(cfg.num_hidden_layers)
        return DecoderState(
            position=torch.zeros(batch, dtype=torch.long, device=device),
            keys=[torch.zeros(shape, device=device, dtype=dtype) for _ in layers],
            values=[torch.zeros(shape, device=device, dtype=dtype) for _ in layers],
        )

    def decode_step(self, codes: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """codes [B, n, 16] (the next n frames of each row) -> waveform [B, n * samples_per_frame].

        `state` is updated in place, so the next call continues exactly where this one stopped."""
        x = self.quantizer.decode(codes)
        x = self.pre_conv(x, state).transpose(1, 2)
        x = self.pre_transformer(x, state).transpose(1, 2)
        for up, convnext in self.upsample:
            x = convnext(up(x, state), state)
        x = self.decoder[0](x, state)
        for block in self.decoder[1:-2]:
            x = block(x, state)
        x = self.decoder[-1](x, state, self.decoder[-2])
        state.position = state.position + codes.shape[1]
        return x[:, 0].clamp(-1.0, 1.0)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Offline decode of whole utterances: codes [B, T, 16] -> [B, T * samples_per_frame]."""
        state = self.new_state(codes.shape[0], codes.device, next(self.parameters()).dtype)
        return self.decode_step(codes, state)
