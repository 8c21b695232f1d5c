"""The Triton varlen decode kernel against the SDPA reference, run by Triton's interpreter on the CPU
(conftest sets TRITON_INTERPRET=1)."""
import pytest
import torch

from engine.core.attention import decode_attention


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
