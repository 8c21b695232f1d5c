"""The fused path's padded prefill (what the GPU replays as one CUDA graph per token bucket) against the unpadded
varlen pass: the same last hidden states and the same keys and values in the real slots, whatever the padding
(Triton kernels through the interpreter, fp32, a tiny checkpoint; bitwise on the GPU: `bench_engine.py --parts
check`)."""
import pytest
import torch

from engine.core.kv_cache import CacheShape
from engine.core.model_runner import ModelRunner
from engine.core.prefill_graphs import PaddedPrefill
from engine.tts import TTSModel


@pytest.fixture(scope="module")
def tts(tiny_checkpoints) -> TTSModel:
    return TTSModel.load(tiny_checkpoints["custom_voice"])


def runner(tts: TTSModel, step_mode: str) -> ModelRunner:
    layers = tts.config.talker.layers
    shape = CacheShape(layers.num_hidden_layers, layers.num_key_value_heads, layers.head_dim, slots=6, capacity=64)
    return ModelRunner(tts.talker, shape, tts.device, tts.dtype, "triton", "triton", step_mode)


@pytest.mark.parametrize("lengths,slots", [([5], [2]), ([5, 17, 3], [4, 0, 5]), ([16], [1]), ([40, 30], [3, 1])],
                         ids=["one-short", "three-in-a-bucket", "exactly-a-bucket", "past-the-largest-bucket"])
def test_padded_prefill_equals_the_unpadded_pass(tts, lengths, slots):
    eager, padded = runner(tts, "eager"), runner(tts, "padded")
    assert isinstance(padded.frame.prefill, PaddedPrefill) and list(padded.frame.prefill.buckets) == [16, 32, 64]
    generator = torch.Generator().manual_seed(sum(lengths))
    prompts = [torch.randn(n, tts.config.talker.layers.hidden_size, generator=generator) for n in lengths]
    got = padded.frame.prefill([p.clone() for p in prompts], slots)
    want = eager.frame.prefill([p.clone() for p in prompts], slots)
    # fp32 matmuls round by their row count on the CPU (~1e-6): a padding leak would differ by O(1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for slot, n in zip(slots, lengths):
        torch.testing.assert_close(padded.cache.k[:, slot, :, :n], eager.cache.k[:, slot, :, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(padded.cache.v[:, slot, :, :n], eager.cache.v[:, slot, :, :n], atol=1e-5, rtol=1e-5)
    untouched = [s for s in range(6) if s not in slots]
    assert not padded.cache.k[:, untouched].any(), "padding wrote outside the scratch slot"
