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

from engine.sampling import (
    SamplerBatch,
    SamplerParams,
    choose,
    gumbel_noise,
    process_talker_logits,
    talker_logits_mask,
    uniform_from_bits,
    warp,
)

EOS = 2150


def random_logits(seed: int, vocab: int = 3072, batch: int = 3) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("frame", [0, 1, 2, 7])
def test_talker_processors_match_transformers(frame):
    logits = random_logits(frame)
    previous = torch.randint(0, 2048, (3, frame), generator=torch.Generator().manual_seed(99))
    seen = torch.zeros(3, 3072, dtype=torch.bool).scatter(1, previous, True)
    suppressed_ids = [i for i in range(2048, 3072) if i != EOS]
    hf = logits.clone()
    for processor in (RepetitionPenaltyLogitsProcessor(1.05), MinNewTokensLengthLogitsProcessor(0, 2, EOS),
                      SuppressTokensLogitsProcessor(suppressed_ids)):
        hf = processor(previous, hf)
    ours = process_talker_logits(logits, seen, torch.full((3,), frame), torch.full((3,), 2), torch.full((3,), 1.05),
                                 talker_logits_mask(3072, EOS), EOS)
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
    ours = warp(logits, SamplerBatch.of([SamplerParams(True, temperature, top_k, top_p)] * 3))
    assert torch.equal(torch.isinf(ours), torch.isinf(hf))
    torch.testing.assert_close(ours[~torch.isinf(ours)], hf[~torch.isinf(hf)])


def test_sampling_stays_inside_top_k_and_depends_only_on_seed_and_counter():
    logits = random_logits(5, vocab=2048, batch=64)
    params = SamplerBatch.of([SamplerParams(True, 0.9, 3, 1.0)] * 64)
    seeds, counters = torch.arange(64) * 7919, torch.full((64,), 5)
    first = choose(logits, params, seeds, counters)
    allowed = torch.topk(logits, 3).indices
    assert (allowed == first[:, None]).any(dim=1).all()
    assert not torch.equal(first, logits.argmax(dim=1))  # it samples, not argmax
    # Each row alone gives the same draw as inside the batch; another counter gives other draws.
    alone = [choose(logits[i:i + 1], SamplerBatch.of([SamplerParams(True, 0.9, 3, 1.0)]), seeds[i:i + 1],
                    counters[i:i + 1]) for i in range(64)]
    assert torch.equal(torch.cat(alone), first)
    assert not torch.equal(choose(logits, params, seeds, counters + 1), first)


def test_sampling_follows_the_distribution():
    """Gumbel-max over counter-based noise draws each token with its softmax probability."""
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).expand(20000, 4)
    params = SamplerBatch.of([SamplerParams(True, 1.0, 0, 1.0)] * 20000)
    draws = choose(logits, params, torch.full((20000,), 3), torch.arange(20000))
    frequency = torch.bincount(draws, minlength=4).float() / 20000
    torch.testing.assert_close(frequency, logits[0].softmax(0), atol=0.015, rtol=0)


def test_greedy_rows_take_the_argmax():
    logits = random_logits(7)
    params = SamplerBatch.of([SamplerParams(False, 0.9, 50, 1.0), SamplerParams(True, 0.9, 50, 1.0),
                              SamplerParams(False, 0.5, 5, 0.5)])
    out = choose(logits, params, torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_noise_is_always_finite():
    """Every possible 23-bit draw maps strictly inside (0, 1): the Gumbel noise is never infinite, so a -inf
    (suppressed) logit can never win the argmax."""
    bits = torch.tensor([0, 1, (1 << 23) - 2, (1 << 23) - 1])
    uniform = uniform_from_bits(bits)
    assert (uniform > 0).all() and (uniform < 1).all()
    assert torch.isfinite(-torch.log(-torch.log(uniform))).all()
    assert torch.isfinite(gumbel_noise(torch.arange(64), torch.arange(64), 3072)).all()


def test_suppressed_ids_are_never_sampled():
    logits = random_logits(11, batch=256)
    suppressed = talker_logits_mask(3072, EOS)
    processed = process_talker_logits(logits, torch.zeros(256, 3072, dtype=torch.bool), torch.full((256,), 5),
                                      torch.full((256,), 2), torch.full((256,), 1.05), suppressed, EOS)
    params = SamplerBatch.of([SamplerParams(True, 0.9, 50, 1.0)] * 256)
    for counter in range(20):
        draws = choose(processed, params, torch.arange(256), torch.full((256,), counter))
        assert not suppressed[draws].any()
