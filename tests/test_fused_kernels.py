"""The fused Triton kernels of the engine's fast frame path against the model's PyTorch code, run by Triton's
interpreter on the CPU (conftest sets TRITON_INTERPRET=1), in fp32 and bf16."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.config import CodecDecoderConfig, TransformerConfig
from engine.kernels import dependent_launch as dependent_launch_module
from engine.kernels.dependent_launch import dependent_launch
from engine.kernels.few_rows_linear import few_rows_linear
from engine.kernels.layer_ops import add_rms_norm, qk_norm_rope_store, silu_mul
from engine.kernels.sampling import fused_choose
from engine.kernels.conv_elementwise import _grid, add_bias_residual, snake_padded
from engine.kernels.rows import copy_rows
from engine.kernels.window_attention import window_attention
from engine.model.codec_decoder import DecoderState, ResidualUnit, SnakeBeta, WindowAttention, window_mask
from engine.model.layers import Attention, LayerScale, RMSNorm, RotaryEmbedding, apply_rope
from engine.sampling import SamplerBatch, choose, draw_counter

DTYPES = [torch.float32, torch.bfloat16]


def tolerance(dtype: torch.dtype) -> dict:
    """fp32: summation order only; bf16: a rounding step apart (Triton's interpreter truncates fp32 -> bf16 where
    the GPU rounds to nearest)."""
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_is_the_residual_add_then_rms_norm(dtype):
    generator = torch.Generator().manual_seed(1)
    norm = RMSNorm(96, 1e-6)
    norm.weight.data = torch.randn(96, generator=generator)
    norm = norm.to(dtype)
    residual = torch.randn(5, 96, generator=generator).to(dtype)
    delta = torch.randn(5, 96, generator=generator).to(dtype)
    expected_sum = residual + delta
    fused_residual = residual.clone()
    normed = add_rms_norm(fused_residual, delta, norm.weight, 1e-6)
    torch.testing.assert_close(fused_residual, expected_sum, **tolerance(dtype))
    torch.testing.assert_close(normed, norm(expected_sum), **tolerance(dtype))
    plain = residual.clone()
    torch.testing.assert_close(add_rms_norm(plain, None, norm.weight, 1e-6), norm(residual), **tolerance(dtype))
    assert torch.equal(plain, residual)
    scale = LayerScale(96, 0.01).to(dtype)  # the codec transformer's branch scale
    scale.scale.data = torch.randn(96, generator=generator).to(dtype)
    scaled = residual.clone()
    normed = add_rms_norm(scaled, delta, norm.weight, 1e-6, scale.scale)
    torch.testing.assert_close(scaled, residual + scale(delta), **tolerance(dtype))
    torch.testing.assert_close(normed, norm(residual + scale(delta)), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_store_matches_the_attention_module(dtype):
    cfg = TransformerConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                              attention_bias=False)
    generator = torch.Generator().manual_seed(2)
    attention = Attention(cfg)
    for param in attention.parameters():
        param.data = torch.randn(param.shape, generator=generator)
    attention = attention.to(dtype)
    rows, heads, kv_heads, dim = 3, 4, 2, 16
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    positions = torch.tensor([0, 7, 130])
    slots = torch.tensor([2, 0, 2])
    k_cache = torch.zeros(4, kv_heads, 160, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    rotary = RotaryEmbedding(dim, 10000.0)
    queries = qk_norm_rope_store(qkv, attention.q_norm.weight, attention.k_norm.weight, rotary.inv_freq("cpu"),
                                 positions, slots, k_cache, v_cache, heads, 1e-6)

    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    cos, sin = rotary(positions[:, None], dtype)
    expected_q = apply_rope(attention.q_norm(q.view(rows, 1, heads, dim)).transpose(1, 2), cos, sin)[:, :, 0]
    expected_k = apply_rope(attention.k_norm(k.view(rows, 1, kv_heads, dim)).transpose(1, 2), cos, sin)[:, :, 0]
    torch.testing.assert_close(queries, expected_q, **tolerance(dtype))
    for row, (slot, position) in enumerate(zip(slots.tolist(), positions.tolist())):
        torch.testing.assert_close(k_cache[slot, :, position], expected_k[row], **tolerance(dtype))
        assert torch.equal(v_cache[slot, :, position], v[row].view(kv_heads, dim))
    assert int((k_cache != 0).any(dim=-1).sum()) == rows * kv_heads  # nothing else written


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_swiglu(dtype):
    gate_up = torch.randn(4, 2 * 1500, generator=torch.Generator().manual_seed(3)).to(dtype)  # two blocks, ragged
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate) * up, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_sampler_picks_the_ids_of_the_reference_sampler(dtype):
    """Temperature, top-k with ties at the k-th value, top-p, greedy rows, -inf logits, negative seeds; the logits
    in the dtype the model writes them (the top-k search then runs over that dtype's bits alone)."""
    generator = torch.Generator().manual_seed(4)
    rows, vocab = 12, 2048
    logits = (torch.randn(rows, vocab, generator=generator) * 3).to(dtype)
    logits[0, 5] = float("-inf")
    logits[1, :1000] = float("-inf")
    logits[2] = torch.round(logits[2] * 2) / 2  # many ties
    params = SamplerBatch(
        do_sample=torch.tensor([True] * 10 + [False] * 2),
        temperature=torch.rand(rows, generator=generator) + 0.5,
        top_k=torch.tensor([50, 0, 10, 1, 2048, 3000, 7, 50, 0, 100, 50, 0]),
        top_p=torch.tensor([1.0, 0.9, 0.8, 1.0, 0.5, 0.95, 1.0, 0.3, 1.0, 0.0, 1.0, 1.0]))
    seeds = torch.randint(0, 2**62, (rows,), generator=generator)
    seeds[3] = -5
    frames = torch.randint(0, 500, (rows,), generator=generator)
    for group in range(4):
        expected = choose(logits, params, seeds, draw_counter(frames, group))
        assert torch.equal(fused_choose(logits, params, seeds, frames, group), expected)


@settings(max_examples=30, deadline=None)
# a rehearsal's draw: the logits rounded to [-0.0, 0.0], a tie the kernel's ordered keys split (-0.0 below +0.0)
@example(rows=1, vocab=2, top_k=0, top_p=0.0, temperature=1.0, steps=0.5, seed=499, dtype=torch.float32)
@example(rows=1, vocab=2, top_k=1, top_p=1.0, temperature=1.0, steps=0.5, seed=499, dtype=torch.float32)
@given(rows=st.integers(1, 3), vocab=st.integers(2, 3072), top_k=st.integers(0, 3100), top_p=st.floats(0.0, 1.0),
       temperature=st.floats(1e-30, 3.0) | st.floats(0.05, 3.0), steps=st.sampled_from([0.0, 0.5, 2.0]),
       seed=st.integers(-2**62, 2**62), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_fused_sampler_picks_the_reference_ids_for_any_settings(rows, vocab, top_k, top_p, temperature, steps, seed,
                                                                 dtype):
    """Generated vocabularies (the code predictor's 2,048 and the talker's 3,072 among them), cut-offs, temperatures
    (tiny ones divide large logits into infinities: ties the logits did not have), logits rounded onto a grid
    (`steps`: many ties at the cut-offs) and the model's dtypes against `sampling.choose`."""
    generator = torch.Generator().manual_seed(abs(seed) % 2**32)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    if steps:
        logits = torch.round(logits * steps) / steps
    logits = logits.to(dtype)
    params = SamplerBatch(do_sample=torch.ones(rows, dtype=torch.bool), temperature=torch.full((rows,), temperature),
                          top_k=torch.full((rows,), top_k), top_p=torch.full((rows,), top_p))
    seeds, frames = torch.full((rows,), seed), torch.arange(rows)
    expected = choose(logits, params, seeds, draw_counter(frames, 3))
    assert torch.equal(fused_choose(logits, params, seeds, frames, 3), expected)


@pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_sampler_top_one_is_exact_at_one_ulp_and_where_the_temperature_makes_ties(dtype):
    """Top-1 draws where the best logit is one ulp of its dtype above the next (rows 0-31: only the best may be drawn),
    and where a tiny temperature divides both into +inf (rows 32-63: the reference keeps both, the first drawn)."""
    rows, vocab = 64, 300
    below = torch.tensor(1.0, dtype=dtype)
    best = below + torch.finfo(dtype).eps  # the next value up: the same exponent, the last mantissa bit
    logits = torch.full((rows, vocab), -20.0, dtype=dtype)
    token = torch.arange(rows) % vocab + 7
    logits[torch.arange(rows), token] = best
    logits[torch.arange(rows), token - 1] = below
    assert (logits[:, 0] < logits[0, token[0] - 1]).all() and below < best
    temperature = torch.where(torch.arange(rows) < 32, 0.9, 1e-45)
    params = SamplerBatch(do_sample=torch.ones(rows, dtype=torch.bool), temperature=temperature,
                          top_k=torch.ones(rows, dtype=torch.long), top_p=torch.ones(rows))
    seeds, frames = torch.arange(rows) * 7919, torch.arange(rows)
    expected = choose(logits, params, seeds, draw_counter(frames, 1))
    assert torch.equal(expected[:32], token[:32]) and torch.equal(expected[32:], token[32:] - 1)
    assert torch.equal(fused_choose(logits, params, seeds, frames, 1), expected)


@pytest.mark.parametrize("context, has_past", [(6, True), (54, True), (6, False), (1, True), (0, False)])
def test_snake_padded_is_snake_beta_after_the_remembered_columns(context, has_past):
    """fp32 only: in bf16 the chain's five roundings and sin's amplification of a one-ulp change make the
    interpreter's truncation (the GPU rounds to nearest) differ from PyTorch by far more than the kernel's own error;
    bf16 is compared bit for bit on the GPU (`scripts/bench_engine.py --parts decoder`)."""
    generator = torch.Generator().manual_seed(context)
    snake = SnakeBeta(12)
    snake.alpha.data = torch.randn(12, generator=generator) * 0.5
    snake.beta.data = torch.randn(12, generator=generator) * 0.5
    x = torch.randn(3, 12, 37, generator=generator) * 4
    past = torch.randn(3, 12, context, generator=generator) if has_past else None
    fused = snake_padded(x, snake.alpha, snake.beta, past, context)
    expected = torch.cat((past if has_past else torch.zeros(3, 12, context), snake(x)), dim=-1)
    assert fused.shape == expected.shape and fused.is_contiguous()
    if past is not None:
        assert torch.equal(fused[..., :context], past)
    torch.testing.assert_close(fused, expected, **tolerance(torch.float32))


def test_snake_padded_reads_a_time_slice_of_a_wider_tensor():
    generator = torch.Generator().manual_seed(3)
    snake = SnakeBeta(5)
    snake.alpha.data = torch.randn(5, generator=generator)
    wide = torch.randn(2, 5, 40, generator=generator)
    x = wide[..., 3:23]  # a transposed convolution's trimmed output: unit stride in time, longer rows
    past = torch.randn(2, 5, 4, generator=generator)
    torch.testing.assert_close(snake_padded(x, snake.alpha, snake.beta, past, 4),
                               torch.cat((past, snake(x)), dim=-1), **tolerance(torch.float32))


@settings(max_examples=25, deadline=None)
@given(channels=st.integers(1, 130), frames=st.integers(1, 70), context=st.integers(0, 60),
       activate=st.booleans(), has_past=st.booleans(), has_bias=st.booleans(), x_minor=st.booleans(),
       past_minor=st.booleans(), out_minor=st.booleans(), trim=st.integers(0, 5), tail_minor=st.sampled_from(
           [None, False, True]), seed=st.integers(0, 2**16))
def test_snake_padded_in_any_layout(channels, frames, context, activate, has_past, has_bias, x_minor, past_minor,
                                    out_minor, trim, tail_minor, seed):
    """Inputs in either layout (channels-minor as the convolutions write them, time-minor, a trimmed view), with or
    without a bias and SnakeBeta, give the same values as PyTorch's bias add, SnakeBeta and cat, written in the
    layout asked: dense, and channels-minor where asked; the last `context` columns copied into a tail in either
    layout where one is given (the decoder pool's rows), nothing else of it written."""
    generator = torch.Generator().manual_seed(seed)
    snake = SnakeBeta(channels)
    snake.alpha.data, snake.beta.data = torch.randn(2, channels, generator=generator) * 0.5
    x = _channels_minor_or_not(torch.randn(2, channels, frames + trim, generator=generator)[..., trim:] * 3, x_minor)
    past = torch.randn(2, channels, context, generator=generator) if has_past and context else None
    if past is not None:
        past = _channels_minor_or_not(past, past_minor)
    bias = torch.randn(channels, generator=generator) if has_bias else None
    alpha, beta = (snake.alpha, snake.beta) if activate else (None, None)
    tail = None
    if tail_minor is not None:  # a view of a wider buffer, as a row of the pool is
        buffer = torch.full((2, context + 3, channels + 2) if tail_minor else (2, channels + 2, context + 3), torch.nan)
        tail = (buffer[:, 1:context + 1, 1:channels + 1].transpose(1, 2) if tail_minor
                else buffer[:, 1:channels + 1, 1:context + 1])
    out = snake_padded(x, alpha, beta, past, context, channels_minor=out_minor, bias=bias, tail=tail)
    new = x if bias is None else x + bias[:, None]
    expected = torch.cat((torch.zeros(2, channels, context) if past is None else past,
                          snake(new) if activate else new), dim=-1)
    assert out.shape == expected.shape
    assert out.transpose(1, 2).is_contiguous() if out_minor else out.is_contiguous()
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    if tail is not None:
        assert torch.equal(tail, out[..., out.shape[-1] - context:])
        assert buffer.isnan().sum() == buffer.numel() - tail.numel()


@settings(max_examples=20, deadline=None)
@given(channels=st.integers(1, 130), frames=st.integers(1, 70), x_minor=st.booleans(), residual_minor=st.booleans(),
       trim=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_add_bias_residual_is_the_two_adds(channels, frames, x_minor, residual_minor, trim, seed):
    """residual + (x + bias) as PyTorch computes it, bit for bit (two adds, each rounded), for a residual that is a
    trimmed view in either layout; the output in x's layout. fp32: the interpreter truncates where it casts to bf16
    (the GPU rounds to nearest); bf16 is compared on the GPU (`scripts/bench_engine.py --parts decoder`)."""
    generator = torch.Generator().manual_seed(seed)
    residual = torch.randn(2, channels, frames + trim, generator=generator)[..., trim:]
    residual = _channels_minor_or_not(residual, residual_minor)
    x = _channels_minor_or_not(torch.randn(2, channels, frames, generator=generator), x_minor)
    bias = torch.randn(channels, generator=generator)
    out = add_bias_residual(residual, x, bias)
    assert torch.equal(out, residual + (x + bias[:, None]))
    assert out.stride() == x.stride()


@settings(max_examples=20, deadline=None)
@given(channels=st.integers(1, 150), frames=st.integers(1, 90), batch=st.integers(1, 3), hidden_minor=st.booleans(),
       residual_minor=st.booleans(), trim=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_snake_pointwise_residual_is_the_residual_units_second_half(channels, frames, batch, hidden_minor,
                                                                    residual_minor, trim, seed):
    """One matrix product with SnakeBeta on its input and the biases and the residual around it gives what the
    plain residual unit's second half gives (bias add, SnakeBeta, 1x1 convolution, residual add), for inputs in
    either layout (a residual that is a trimmed view), more rows and channels than one tile; the output in the
    hidden activation's layout. fp32 (full precision, not TF32); bf16 is compared on the GPU
    (`scripts/bench_engine.py --parts decoder`)."""
    generator = torch.Generator().manual_seed(seed)
    unit = ResidualUnit("unit", channels, 1)
    for parameter in unit.parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator) * 0.5
    hidden = _channels_minor_or_not(torch.randn(batch, channels, frames, generator=generator) * 3, hidden_minor)
    residual = torch.randn(batch, channels, frames + trim, generator=generator)[..., trim:]
    residual = _channels_minor_or_not(residual, residual_minor)
    out = unit.fused_tail(residual, hidden)
    activated = unit.act2(hidden + unit.conv1.conv.bias[:, None])
    expected = residual + F.conv1d(activated, unit.conv2.conv.weight, unit.conv2.conv.bias)
    assert out.transpose(1, 2).is_contiguous() if hidden_minor else out.is_contiguous()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("batch, frames", [(1, 8192), (257, 4), (257, 64)])
def test_conv_kernel_grids_fit_cuda_limits(batch, frames):
    """A whole-utterance decode (`voxgate synthesize`: up to 8,192 frames, the last block's 96 channels at 1,920 columns
    a frame) and the largest batch stay within CUDA's grid: 2**31 - 1 programs on the first axis, 65,535 on the others
    (a time axis there failed from 2,185 frames on)."""
    for channels in (96, 1536):
        first, second, third = _grid(batch, channels, frames * 1920 + 54)
        assert first < 2**31 and second <= 65_535 and third <= 65_535


def _channels_minor_or_not(t: torch.Tensor, channels_minor: bool) -> torch.Tensor:
    return t.transpose(1, 2).contiguous().transpose(1, 2) if channels_minor else t


def _random_linear(features: int, width: int, bias: bool, dtype: torch.dtype, seed: int) -> torch.nn.Linear:
    generator = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(width, features, bias=bias)
    linear.weight.data = torch.randn(features, width, generator=generator) / width ** 0.5
    if bias:
        linear.bias.data = torch.randn(features, generator=generator)
    return linear.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, features, width, bias, rows_per_program", [
    (1, 48, 96, False, 1), (1, 40, 200, True, 1), (5, 40, 200, True, 1), (5, 24, 72, False, 4), (9, 16, 64, False, 2)])
def test_few_rows_linear_with_a_norm_before_it_is_rms_norm_then_linear(dtype, rows, features, width, bias,
                                                                      rows_per_program):
    """Ragged features and widths (not multiples of the blocks), more rows than one program takes, a bias."""
    linear = _random_linear(features, width, bias, dtype, seed=rows)
    norm = RMSNorm(width, 1e-6)
    norm.weight.data = torch.randn(width, generator=torch.Generator().manual_seed(9))
    norm = norm.to(dtype)
    x = (torch.randn(rows, width, generator=torch.Generator().manual_seed(10)) * 3).to(dtype)
    blocks = dict(block_n=16, block_k=32, rows_per_program=rows_per_program)
    fused = few_rows_linear(x, linear.weight, linear.bias, norm=norm.weight, eps=1e-6, **blocks)
    torch.testing.assert_close(fused, linear(norm(x)), **tolerance(dtype))
    torch.testing.assert_close(few_rows_linear(x, linear.weight, linear.bias, **blocks), linear(x),
                               **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_few_rows_linear_after_swiglu_adds_into_the_residual(dtype):
    rows, features, width = 3, 40, 72
    linear = _random_linear(features, width, False, dtype, seed=4)
    gate_up = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(5)).to(dtype)
    residual = torch.randn(rows, features, generator=torch.Generator().manual_seed(6)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = residual + linear(F.silu(gate) * up)
    stream = residual.clone()
    returned = few_rows_linear(gate_up, linear.weight, swiglu=True, residual=stream, block_k=32)
    assert returned is stream
    torch.testing.assert_close(stream, expected, **tolerance(dtype))


@pytest.mark.parametrize("rows_per_program", [1, 4])
def test_few_rows_linear_gives_a_row_the_same_bits_alone_and_in_a_batch(rows_per_program):
    """The seed guarantee: each row is its own fixed-order reduction, whatever the other rows are."""
    linear = _random_linear(24, 80, True, torch.float32, seed=7)
    norm_weight = torch.randn(80, generator=torch.Generator().manual_seed(8))
    batch = torch.randn(11, 80, generator=torch.Generator().manual_seed(9))
    blocks = dict(block_k=32, rows_per_program=rows_per_program)
    together = few_rows_linear(batch, linear.weight, linear.bias, norm=norm_weight, **blocks)
    for row in (0, 6, 10):
        alone = few_rows_linear(batch[row:row + 1].clone(), linear.weight, linear.bias, norm=norm_weight, **blocks)
        assert torch.equal(alone[0], together[row])


@pytest.mark.parametrize("capability, interpreted, switch, expected", [
    (9, False, None, True),  # Hopper: the chain launches with PDL
    (10, False, "1", True),
    (8, False, None, False),  # before Hopper there is no programmatic launch
    (9, True, None, False),  # the interpreter cannot wait on a grid
    (9, False, "0", False),  # VOXGATE_DEPENDENT_LAUNCH=0: launched as before (the benchmarks' before)
])
def test_dependent_launch_only_where_the_gpu_and_the_switch_allow_it(monkeypatch, capability, interpreted, switch,
                                                                     expected):
    monkeypatch.setattr(dependent_launch_module.torch.cuda, "get_device_capability", lambda index: (capability, 0))
    dependent_launch_module._launches_dependently.cache_clear()
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpreted else "0")
    if switch is None:
        monkeypatch.delenv("VOXGATE_DEPENDENT_LAUNCH", raising=False)
    else:
        monkeypatch.setenv("VOXGATE_DEPENDENT_LAUNCH", switch)
    assert dependent_launch(torch.device("cuda", 0)) is expected
    assert dependent_launch(torch.device("cpu")) is False
    dependent_launch_module._launches_dependently.cache_clear()  # no answer from a patched GPU stays behind


def _window_attention_module(heads: int, kv_heads: int, dtype: torch.dtype, seed: int) -> WindowAttention:
    cfg = CodecDecoderConfig(codebook_size=16, codebook_dim=8, latent_dim=16, decoder_dim=16, hidden_size=32,
                             intermediate_size=64, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             head_dim=16, num_hidden_layers=1, sliding_window=12, rope_theta=10000.0,
                             rms_norm_eps=1e-5, layer_scale_initial_scale=0.01, num_quantizers=2,
                             upsample_rates=(2,), upsampling_ratios=(2,))
    generator = torch.Generator().manual_seed(seed)
    attention = WindowAttention(cfg)
    for param in attention.parameters():
        param.data = torch.randn(param.shape, generator=generator) * 0.3
    return attention.to(dtype)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(DTYPES), st.sampled_from([(4, 4), (4, 2), (2, 1)]), st.integers(1, 3), st.integers(1, 5),
       st.lists(st.integers(0, 40), min_size=3, max_size=3), st.integers(0, 2**16))
@torch.inference_mode()
def test_window_attention_is_the_decoder_transformers_attention(dtype, heads, rows, frames, positions, seed):
    """RoPE, the window's shift and the masked attention in one kernel, against `WindowAttention`'s PyTorch code:
    streams at their start (fewer frames than the window: the zeros before them unseen) and past it, several frames
    a call, grouped query heads; the next call's window too."""
    attention = _window_attention_module(*heads, dtype, seed)
    window, kv_heads, dim = attention.window, attention.kv_heads, attention.head_dim
    generator = torch.Generator().manual_seed(seed)
    position = torch.tensor(positions[:rows])
    x = torch.randn(rows, frames, 32, generator=generator).to(dtype)
    past_keys, past_values = (torch.randn(rows, kv_heads, window, dim, generator=generator).to(dtype)
                              for _ in range(2))
    cos, sin = RotaryEmbedding(dim, 10000.0)(position[:, None] + torch.arange(frames)[None], dtype)
    state = DecoderState(position=position, keys=[past_keys.clone()], values=[past_values.clone()])
    expected = attention(x, cos, sin, window_mask(position, frames, window), state, 0)
    outs = [torch.full((rows, kv_heads + 1, window, dim), torch.nan, dtype=dtype)[:, 1:] for _ in range(2)]
    out, keys, values = window_attention(F.linear(x, *attention._qkv()), cos, sin, past_keys, past_values, position,
                                         attention.heads, *(outs if seed % 2 else ()))
    torch.testing.assert_close(keys, state.keys[0], **tolerance(dtype))
    assert torch.equal(values, state.values[0])  # moved, never computed
    if seed % 2:  # written where given (the decoder pool's rows: other strides than the past's)
        assert keys is outs[0] and values is outs[1]
    if dtype == torch.float32:
        torch.testing.assert_close(attention.o_proj(out), expected, **tolerance(dtype))
    else:  # a key a bf16 step apart moves every weight a little, and the interpreter truncates each of the ~6
        # roundings where the GPU rounds to nearest (up to 2^-7 each): the whole output within a few of those
        difference = (attention.o_proj(out) - expected).float().norm() / expected.float().norm()
        assert difference < 5e-2, difference


@settings(max_examples=20, deadline=None)
@given(pool_rows=st.integers(1, 6), width=st.integers(1, 9000), data=st.data())
def test_copy_rows_gathers_and_scatters_by_index(pool_rows, width, data):
    """The decoder pool's gather and scatter: rows chosen by index, any order, into a dense batch and back; rows
    not named are left as they were. Widths across the kernel's block (4,096)."""
    generator = torch.Generator().manual_seed(width)
    pool = torch.randn(pool_rows, width, generator=generator)
    chosen = data.draw(st.lists(st.integers(0, pool_rows - 1), min_size=1, max_size=pool_rows, unique=True))
    index, dense = torch.tensor(chosen), torch.arange(len(chosen))
    batch = torch.empty(len(chosen), width)
    copy_rows(pool, index, batch, dense)
    assert torch.equal(batch, pool[index])
    updated, before = torch.randn(len(chosen), width, generator=generator), pool.clone()
    copy_rows(updated, dense, pool, index)
    expected = before.clone()
    expected[index] = updated
    assert torch.equal(pool, expected)
