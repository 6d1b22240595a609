"""Sampling parameters and the batched sampler on synthetic logits."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import SampleInput, Sampler, SamplingError, SamplingParams


def rows(*params: SamplingParams, gens=None, outputs=None):
    gens = gens or [None] * len(params)
    outputs = outputs or [[] for _ in params]
    return [SampleInput(p, [], o, g) for p, o, g in zip(params, outputs, gens)]


def draw(logits, params, n=2000, seed=0):
    sampler = Sampler(torch.Generator().manual_seed(seed))
    counts = torch.zeros(logits.shape[-1])
    for _ in range(n):
        tok = sampler(logits[None].clone(), rows(params)).token_ids[0]
        counts[tok] += 1
    return counts / n


@pytest.mark.parametrize(
    "bad",
    [
        dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-3),
        dict(min_p=2), dict(repetition_penalty=0), dict(presence_penalty=3), dict(frequency_penalty=-3),
        dict(seed="x"), dict(stop=[""]), dict(stop_token_ids=[-1]), dict(logprobs=99), dict(temperature=float("nan")),
    ],
)
def test_bad_values_are_rejected_with_the_parameter_named(bad):
    with pytest.raises(SamplingError) as e:
        SamplingParams.from_dict(bad)
    assert next(iter(bad)) in str(e.value)


def test_unknown_parameter_names_are_rejected():
    with pytest.raises(SamplingError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"temprature": 0.5})


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    out = Sampler(torch.Generator())(logits, rows(SamplingParams(temperature=0), SamplingParams(temperature=0)))
    assert out.token_ids == [1, 0]


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    assert set(draw(logits, SamplingParams(top_k=2)).nonzero().flatten().tolist()) == {0, 1}
    assert set(draw(logits, SamplingParams(top_p=0.65)).nonzero().flatten().tolist()) == {0, 1}
    assert set(draw(logits, SamplingParams(min_p=0.4)).nonzero().flatten().tolist()) == {0, 1, 2}  # >= 0.16


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    freq = draw(torch.log(probs), SamplingParams(temperature=1.0), n=4000)
    assert torch.allclose(freq, probs, atol=0.03)


def test_low_temperature_sharpens():
    freq = draw(torch.log(torch.tensor([0.5, 0.3, 0.2])), SamplingParams(temperature=0.2), n=1000)
    assert freq[0] > 0.9


def test_seeded_request_is_reproducible_whatever_the_batch():
    logits = torch.randn(4, 50)
    p = SamplingParams(temperature=1.0, seed=123)
    a = [Sampler(torch.Generator().manual_seed(1))(logits[:1], rows(p, gens=[torch.Generator().manual_seed(123)])).token_ids[0]]
    gen = torch.Generator().manual_seed(123)
    other = SamplingParams(temperature=1.0)
    b = Sampler(torch.Generator().manual_seed(99))(logits, rows(p, other, other, other, gens=[gen, None, None, None])).token_ids[0]
    assert a[0] == b


def test_repetition_and_frequency_penalties():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    sampler = Sampler(torch.Generator())
    assert sampler(logits.clone(), [SampleInput(SamplingParams(temperature=0), [0], [], None)]).token_ids == [0]
    penalized = [SampleInput(SamplingParams(temperature=0, repetition_penalty=1.5), [0], [], None)]
    assert sampler(logits.clone(), penalized).token_ids == [1]
    freq = [SampleInput(SamplingParams(temperature=0, frequency_penalty=0.5), [], [0], None)]
    assert sampler(logits.clone(), freq).token_ids == [1]
    presence = [SampleInput(SamplingParams(temperature=0, presence_penalty=0.2), [], [0], None)]
    assert sampler(logits.clone(), presence).token_ids == [1]


def test_logprobs_of_the_chosen_token_and_top_alternatives():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    out = Sampler(torch.Generator())(logits, rows(SamplingParams(temperature=0, logprobs=2)))
    lp = out.logprobs[0]
    assert set(lp) == {0, 1}
    assert lp[0] == pytest.approx(torch.log(torch.tensor(0.6)).item(), abs=1e-5)
