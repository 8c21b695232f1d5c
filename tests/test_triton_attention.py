"""The Triton varlen decode kernel against the SDPA reference, and the fused decode kernel (norm, RoPE, cache write
and attention) against the two kernels it replaces, run by Triton's interpreter on the CPU (conftest sets
TRITON_INTERPRET=1)."""
import pytest
import torch

from engine.core.attention import decode_attention
from engine.kernels.attention import norm_rope_attention, varlen_attention
from engine.kernels.layer_ops import qk_norm_rope_store
from engine.model.layers import RotaryEmbedding


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (16, 8, 32)])
def test_triton_kernel_matches_sdpa(heads, kv_heads, head_dim):
    generator = torch.Generator().manual_seed(heads)
    slots, capacity = 6, 150
    k_cache = torch.randn(slots, kv_heads, capacity, head_dim, generator=generator)
    v_cache = torch.randn(slots, kv_heads, capacity, head_dim, generator=generator)
    q = torch.randn(4, heads, 1, head_dim, generator=generator)
    rows = torch.tensor([5, 0, 3, 2])
    lengths = torch.tensor([1, 64, 65, 150])  # one key, exactly one block, a block and one, the whole slot
    expected = decode_attention(q, k_cache, v_cache, rows, lengths, "sdpa")
    got = decode_attention(q, k_cache, v_cache, rows, lengths, "triton")
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


DECODE_SHAPES = [(16, 8, 128, 16), (4, 2, 16, 8), (8, 2, 32, 4), (2, 2, 16, 8)]  # the models' 16/8/128 first


def decode_inputs(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> dict:
    """A decode step of five rows in non-contiguous slots of random caches (earlier positions already written), at
    positions from a slot's start (0) to its last (39)."""
    generator = torch.Generator().manual_seed(heads * head_dim + kv_heads)

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    return dict(qkv=random(5, (heads + 2 * kv_heads) * head_dim), q_norm=random(head_dim), k_norm=random(head_dim),
                inv_freq=RotaryEmbedding(head_dim, 10000.0).inv_freq("cpu"), positions=torch.tensor([0, 5, 16, 39, 23]),
                slots=torch.tensor([7, 0, 3, 9, 5]), k_cache=random(10, kv_heads, 40, head_dim),
                v_cache=random(10, kv_heads, 40, head_dim), q_heads=heads, eps=1e-6)


def two_kernels(block_n: int, qkv, q_norm, k_norm, inv_freq, positions, slots, k_cache, v_cache, q_heads, eps):
    queries = qk_norm_rope_store(qkv, q_norm, k_norm, inv_freq, positions, slots, k_cache, v_cache, q_heads, eps)
    return varlen_attention(queries, k_cache, v_cache, slots, positions + 1, block_n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_n", DECODE_SHAPES)
def test_fused_decode_kernel_is_the_two_kernels_bit_for_bit(heads, kv_heads, head_dim, block_n, dtype):
    """Same output and same caches afterwards, over lengths of one key to several blocks of them."""
    inputs = decode_inputs(heads, kv_heads, head_dim, dtype)
    fused_inputs = dict(inputs, k_cache=inputs["k_cache"].clone(), v_cache=inputs["v_cache"].clone())
    expected = two_kernels(block_n, **inputs)
    got = norm_rope_attention(**fused_inputs, block_n=block_n)
    assert torch.equal(got, expected)
    assert torch.equal(fused_inputs["k_cache"], inputs["k_cache"])
    assert torch.equal(fused_inputs["v_cache"], inputs["v_cache"])


def test_fused_decode_kernel_rows_do_not_depend_on_the_batch():
    """A row's output is the same alone as among others (no split that depends on the batch)."""
    inputs = decode_inputs(4, 2, 16, torch.bfloat16)
    batch = norm_rope_attention(**dict(inputs, k_cache=inputs["k_cache"].clone(), v_cache=inputs["v_cache"].clone()),
                                block_n=8)
    for row in range(5):
        alone = dict(inputs, qkv=inputs["qkv"][row:row + 1], positions=inputs["positions"][row:row + 1],
                     slots=inputs["slots"][row:row + 1], k_cache=inputs["k_cache"].clone(),
                     v_cache=inputs["v_cache"].clone())
        assert torch.equal(norm_rope_attention(**alone, block_n=8)[0], batch[row])
