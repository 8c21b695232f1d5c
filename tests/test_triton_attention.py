"""The Triton varlen decode kernel against the SDPA reference, run by Triton's interpreter on the CPU
(conftest sets TRITON_INTERPRET=1): generated shapes (GQA groups, head dims below and above tl.dot's 16, caches of
the code predictor's 16 positions and longer), fp32 and bf16, and a row's result independent of its batch."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.attention import decode_attention
from engine.kernels.attention import varlen_attention


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


@settings(max_examples=25, deadline=None)
@given(kv_heads=st.sampled_from([1, 2, 8]), group=st.sampled_from([1, 2, 4]), head_dim=st.sampled_from([8, 16, 64]),
       capacity=st.sampled_from([2, 16, 100]), rows=st.integers(1, 5), dtype=st.sampled_from(["float32", "bfloat16"]),
       seed=st.integers(0, 2**16))
def test_generated_shapes_match_sdpa_and_a_row_does_not_depend_on_its_batch(kv_heads, group, head_dim, capacity, rows,
                                                                            dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, dtype)
    slots = rows + 1
    k_cache = torch.randn(slots, kv_heads, capacity, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(slots, kv_heads, capacity, head_dim, generator=generator).to(dtype)
    q = torch.randn(rows, kv_heads * group, head_dim, generator=generator).to(dtype)
    row_slots = torch.randperm(slots, generator=generator)[:rows]
    lengths = torch.randint(1, capacity + 1, (rows,), generator=generator)
    got = varlen_attention(q, k_cache, v_cache, row_slots, lengths)
    expected = decode_attention(q.float()[:, :, None], k_cache.float(), v_cache.float(), row_slots, lengths,
                                "sdpa")[:, :, 0]
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), expected, **tolerance)
    for row in range(rows):  # alone, the same bits as in the batch
        alone = varlen_attention(q[row:row + 1], k_cache, v_cache, row_slots[row:row + 1], lengths[row:row + 1])
        assert torch.equal(alone[0], got[row])
