"""Roofline timing model: batch-1 decode near the bandwidth roofline, shapes from scheduler
outputs, the linear prior, and saturation throughput near published numbers."""

import pytest

from chaos.bench.sim import run_saturation, sharegpt_like_lengths
from engine.config import model_preset
from engine.gpus import get_gpu
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.timing_model import StepShape, TimingModel, step_cost
from policies.step_time import StepTimeModel

LLAMA = model_preset("llama-7b")


@pytest.mark.parametrize("gpu,roofline_ms", [("a100-80g", 7.0), ("h100-80g", 4.3), ("h200", 3.0)])
def test_batch1_decode_sits_near_bandwidth_roofline(gpu, roofline_ms):
    timing = TimingModel(LLAMA, get_gpu(gpu))
    shape = StepShape(num_decode_seqs=1, num_context_tokens=0)
    cost = timing.cost(shape)
    ideal_s = cost.bytes_moved / get_gpu(gpu).hbm_bytes_per_s
    assert ideal_s * 1e3 == pytest.approx(roofline_ms, rel=0.03)
    assert ideal_s < timing.step_s(shape) <= 1.10 * ideal_s


def test_empty_step_costs_nothing():
    timing = TimingModel(LLAMA, get_gpu("h100-80g"))
    assert timing.step_s(StepShape()) == 0.0
    assert step_cost(LLAMA, StepShape()).flops == 0.0


def test_decode_is_memory_bound_and_context_costs_bandwidth():
    timing = TimingModel(LLAMA, get_gpu("h100-80g"))
    short = timing.predict_s(0, 32, 32 * 128)
    long = timing.predict_s(0, 32, 32 * 4096)
    kv = 2 * 32 * 8 * 128 * 2
    extra_s = 32 * (4096 - 128) * kv / (3.35e12 * timing.bw_efficiency)
    assert long - short == pytest.approx(extra_s, rel=1e-6)


def test_large_prefill_is_compute_bound_and_linear():
    timing = TimingModel(LLAMA, get_gpu("a100-80g"))
    cost = timing.cost(StepShape(num_prefill_tokens=2048))
    assert timing.compute_s(cost) > timing.memory_s(cost)
    t1 = timing.step_s(StepShape(num_prefill_tokens=1024, num_prefill_attention_pairs=0))
    t2 = timing.step_s(StepShape(num_prefill_tokens=2048, num_prefill_attention_pairs=0))
    assert (t2 - timing.overhead_s) == pytest.approx(2 * (t1 - timing.overhead_s), rel=0.02)


def _seq(rid, n_new, n_computed, n_prompt, samples):
    return ScheduledSeq(request_id=rid, token_ids=tuple(range(300, 300 + n_new)),
                        num_computed_tokens=n_computed, num_prompt_tokens=n_prompt,
                        block_ids=(0,), samples=samples, params=SamplingParams())


def test_step_shape_from_scheduler_output():
    out = SchedulerOutput(batch_id=3, scheduled=(
        _seq("chunk", 4, 8, 20, False),       # middle prefill chunk
        _seq("last", 5, 10, 15, True),        # last chunk: samples
        _seq("d1", 1, 30, 20, True),          # decodes
        _seq("d2", 1, 50, 40, True),
    ))
    shape = StepShape.from_scheduler_output(out)
    assert shape.num_prefill_tokens == 9
    assert shape.num_decode_seqs == 2
    assert shape.num_context_tokens == 80
    assert shape.num_prefill_cached_tokens == 18
    assert shape.num_prefill_attention_pairs == (4 * 8 + 10) + (5 * 10 + 15)
    assert shape.num_sampled_seqs == 3


def test_step_time_prior_is_a_usable_linear_fit():
    timing = TimingModel(LLAMA, get_gpu("h100-80g"))
    prior = timing.as_step_time_prior()
    assert set(prior) == {"base_s", "per_prefill_token_s", "per_decode_seq_s",
                          "per_context_token_s"}
    assert all(v >= 0 for v in prior.values())
    linear = StepTimeModel(**prior)
    for p, d, c in [(0, 1, 512), (0, 64, 64 * 512), (0, 256, 256 * 512), (1024, 0, 0),
                    (512, 128, 128 * 512)]:
        assert linear.step_s(p, d, c) == pytest.approx(timing.predict_s(p, d, c), rel=0.35)
    assert timing.as_dict()["step_time_prior"] == prior


@pytest.mark.parametrize("kwargs", [dict(bw_efficiency=0.0), dict(flops_efficiency=1.5),
                                    dict(overhead_s=-1.0), dict(dtype_bytes=3)])
def test_invalid_parameters_raise(kwargs):
    with pytest.raises(ValueError):
        TimingModel(LLAMA, get_gpu("h200"), **kwargs)
    with pytest.raises(ValueError):
        StepShape(num_decode_seqs=-1)


def test_sharegpt_like_lengths_have_the_published_shape():
    lengths = sharegpt_like_lengths(2000, seed=1)
    mean_prompt = sum(p for p, _ in lengths) / len(lengths)
    mean_output = sum(o for _, o in lengths) / len(lengths)
    assert 190 < mean_prompt < 270 and 170 < mean_output < 230
    assert lengths == sharegpt_like_lengths(2000, seed=1)


def test_saturation_throughput_8b_a100_near_published():
    """vLLM v0.6 / SGLang v0.3 publish ~4,100 / ~4,300 output tokens/s for an 8B model on one
    A100-80GB on ShareGPT; the sim must land within ±30 % (virtual clock: no sleeping)."""
    result = run_saturation("llama-3.1-8b", "a100-80g", num_requests=600)
    assert result.num_output_tokens > 100_000
    assert 0.7 * 4100 <= result.output_tokens_per_s <= 1.3 * 4300
