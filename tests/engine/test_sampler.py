"""Sampler: greedy, seeded reproducibility, top-k / top-p filtering, temperature."""

from __future__ import annotations

import torch

from engine.sampler import Sampler
from engine.sampling_params import SamplingParams

LOGITS = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0],
                       [4.0, 0.0, 0.0, 0.0, 3.9]])


def draw(sampler: Sampler, params: SamplingParams, n: int, request_id: str = "r") -> list[int]:
    return [sampler.sample(LOGITS[:1].clone(), [request_id], [params])[0] for _ in range(n)]


def test_greedy_takes_the_argmax_per_row():
    sampler = Sampler()
    params = SamplingParams.greedy_params(1)
    assert sampler.sample(LOGITS.clone(), ["a", "b"], [params, params]) == [1, 0]


def test_mixed_greedy_and_random_rows_in_one_batch():
    sampler = Sampler()
    rows = [SamplingParams.greedy_params(1), SamplingParams(top_k=1)]
    assert sampler.sample(LOGITS.clone(), ["a", "b"], rows) == [1, 0]


def test_seeded_requests_reproduce_and_differ_by_seed():
    params = SamplingParams(temperature=1.0, seed=123)
    first = draw(Sampler(seed=0), params, 30)
    again = draw(Sampler(seed=99), params, 30)  # the engine seed does not matter
    other = draw(Sampler(seed=0), SamplingParams(temperature=1.0, seed=124), 30)
    assert first == again
    assert first != other


def test_generator_state_is_per_request_and_released():
    sampler = Sampler()
    params = SamplingParams(seed=7)
    solo = draw(Sampler(), params, 10, "x")
    interleaved = []
    for _ in range(10):  # another seeded request drawing in between must not disturb "x"
        interleaved.append(draw(sampler, params, 1, "x")[0])
        draw(sampler, params, 1, "y")
    assert interleaved == solo
    sampler.release(["x"])
    assert draw(sampler, params, 10, "x") == solo


def test_top_k_and_top_p_restrict_the_support():
    sampler = Sampler(seed=1)
    assert set(draw(sampler, SamplingParams(top_k=2), 200)) == {1, 3}
    # probs ~ [0.03, 0.64, 0.09, 0.23, 0.01]: top_p 0.8 keeps tokens 1 and 3 only
    assert set(draw(sampler, SamplingParams(top_p=0.8), 200)) == {1, 3}
    assert set(draw(sampler, SamplingParams(top_p=0.5), 50)) == {1}


def test_temperature_sharpens_and_flattens():
    sampler = Sampler(seed=2)
    cold = draw(sampler, SamplingParams(temperature=0.05), 100)
    hot = draw(sampler, SamplingParams(temperature=5.0), 400)
    assert set(cold) == {1}
    assert set(hot) == {0, 1, 2, 3, 4}
    frequency_of_best = hot.count(1) / len(hot)
    assert 0.2 < frequency_of_best < 0.45  # softmax(logits / 5)[1] = 0.30


def test_unseeded_sampling_follows_the_distribution():
    sampler = Sampler(seed=3)
    counts = torch.bincount(torch.tensor(draw(sampler, SamplingParams(), 2000)), minlength=5)
    expected = torch.softmax(LOGITS[0], dim=0) * 2000
    assert torch.all((counts - expected).abs() < 5 * expected.sqrt() + 5)
