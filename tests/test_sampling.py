"""Our logits processors and warpers against the Hugging Face ones the reference's `generate` uses."""
import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.sampling import SamplerParams, choose, process_talker_logits, talker_logits_mask, warp

EOS = 2150


def random_logits(seed: int, vocab: int = 3072, batch: int = 3) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("frame", [0, 1, 2, 7])
def test_talker_processors_match_transformers(frame):
    logits = random_logits(frame)
    previous = torch.randint(0, 2048, (3, frame), generator=torch.Generator().manual_seed(99))
    suppressed_ids = [i for i in range(2048, 3072) if i != EOS]
    hf = logits.clone()
    for processor in (RepetitionPenaltyLogitsProcessor(1.05), MinNewTokensLengthLogitsProcessor(0, 2, EOS),
                      SuppressTokensLogitsProcessor(suppressed_ids)):
        hf = processor(previous, hf)
    ours = process_talker_logits(logits, previous, frame, 1.05, talker_logits_mask(3072, EOS), EOS)
    torch.testing.assert_close(ours, hf, rtol=0, atol=0)
    assert torch.isinf(ours[:, 2048:]).sum() == 3 * (1023 + (frame < 2))


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.9, 50, 1.0), (0.7, 0, 0.8), (1.3, 5, 0.5), (1.0, 2048, 0.95)])
def test_warpers_match_transformers(temperature, top_k, top_p):
    logits = random_logits(int(temperature * 10) + top_k, vocab=2048)
    hf = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        hf = TopKLogitsWarper(top_k)(None, hf)
    if top_p < 1.0:
        hf = TopPLogitsWarper(top_p)(None, hf)
    ours = warp(logits, SamplerParams(True, temperature, top_k, top_p))
    assert torch.equal(torch.isinf(ours), torch.isinf(hf))
    torch.testing.assert_close(ours[~torch.isinf(ours)], hf[~torch.isinf(hf)])


def test_sampling_stays_inside_top_k_and_is_seeded():
    logits = random_logits(5, vocab=2048, batch=64)
    params = SamplerParams(True, 0.9, 3, 1.0)
    first = choose(logits, params, torch.Generator().manual_seed(1))
    again = choose(logits, params, torch.Generator().manual_seed(1))
    allowed = torch.topk(logits, 3).indices
    assert torch.equal(first, again)
    assert (allowed == first[:, None]).any(dim=1).all()
    assert not torch.equal(first, logits.argmax(dim=1))  # it samples, not argmax


def test_greedy_is_argmax():
    logits = random_logits(7)
    assert torch.equal(choose(logits, SamplerParams(False, 0.9, 50, 1.0), None), logits.argmax(dim=1))
