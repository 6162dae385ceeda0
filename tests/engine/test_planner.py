"""Capacity planner: the reference model's memory plan and the decode roofline rows."""

import dataclasses

import pytest

from engine.config import model_preset
from engine.gpus import GPUSpec, get_gpu, gpu_names
from engine.planner import (
    RUNTIME_RESERVE_BYTES,
    activation_bytes,
    batch_sizes,
    num_kv_blocks,
    plan,
    plan_memory,
)

MIB = 1 << 20


def reference_plan(gpu="h100-80g", **kwargs):
    return plan(model_preset("llama-7b"), get_gpu(gpu), 2048, 256, **kwargs)


def test_reference_model_kv_sizes():
    m = reference_plan().memory
    assert m.kv_bytes_per_token == 131_072 == 2 * 32 * 8 * 128 * 2
    assert m.kv_bytes_per_request == 301_989_888 == 288 * MIB
    assert m.kv_bytes_per_block == 16 * 131_072
    assert m.blocks_per_request == 144  # 2304 / 16


def test_memory_split_adds_up_exactly():
    model, gpu = model_preset("llama-7b"), get_gpu("a100-80g")
    m = plan_memory(model, gpu, 2048, 256)
    assert m.weight_bytes == model.num_params * 2
    assert m.budget_bytes == int(gpu.memory_bytes * 0.9)
    assert m.activation_bytes == activation_bytes(model, 2048, 256)
    expected_kv = m.budget_bytes - m.weight_bytes - m.activation_bytes - RUNTIME_RESERVE_BYTES
    assert m.kv_cache_bytes == expected_kv
    assert m.num_kv_blocks == expected_kv // m.kv_bytes_per_block
    assert m.max_concurrent_requests == m.num_kv_blocks // 144
    assert num_kv_blocks(model, gpu) == m.num_kv_blocks


def test_more_memory_and_utilization_give_more_blocks():
    a100, h200 = reference_plan("a100-80g").memory, reference_plan("h200").memory
    assert h200.num_kv_blocks > 1.8 * a100.num_kv_blocks
    low = reference_plan("h100-80g", gpu_memory_utilization=0.5).memory
    assert low.num_kv_blocks < reference_plan("h100-80g").memory.num_kv_blocks


def test_model_that_does_not_fit_reports_zero_capacity():
    small = GPUSpec("small", "8 GiB card", 1e12, 1e14, 8 << 30)
    serving = plan(model_preset("llama-7b"), small, 2048, 256)
    assert serving.memory.kv_cache_bytes == 0
    assert serving.memory.num_kv_blocks == 0
    assert not serving.memory.fits
    assert serving.roofline == ()


def test_roofline_rows_are_consistent():
    serving = reference_plan()
    rows = serving.roofline
    max_batch = serving.memory.max_concurrent_requests
    assert [r.batch_size for r in rows] == list(batch_sizes(max_batch))
    assert rows[0].batch_size == 1 and rows[-1].batch_size == max_batch
    assert rows[0].bound == "memory"
    assert rows[0].context_tokens_per_seq == 2048 + 128
    for prev, row in zip(rows, rows[1:], strict=False):
        assert row.arithmetic_intensity > prev.arithmetic_intensity
        assert row.bytes_moved > prev.bytes_moved and row.flops > prev.flops
        assert row.tokens_per_s > prev.tokens_per_s
    for row in rows:
        assert row.predicted_step_s >= row.roofline_step_s
        assert row.tokens_per_s == pytest.approx(row.batch_size / row.predicted_step_s)
        assert row.arithmetic_intensity == pytest.approx(row.flops / row.bytes_moved)


def test_compute_bound_rows_appear_past_the_ridge():
    # short contexts keep KV traffic small, so large batches cross the ridge point
    serving = plan(model_preset("llama-7b"), get_gpu("a100-80g"), 16, 16)
    bounds = [r.bound for r in serving.roofline]
    assert bounds[0] == "memory" and bounds[-1] == "compute"
    ridge = get_gpu("a100-80g").ridge_flops_per_byte
    for r in serving.roofline:
        assert (r.arithmetic_intensity > ridge) == (r.bound == "compute")


def test_prefill_time_is_positive_and_grows_with_prompt():
    short = plan(model_preset("llama-7b"), get_gpu("h100-80g"), 512, 16).prefill_s
    long = plan(model_preset("llama-7b"), get_gpu("h100-80g"), 4000, 16).prefill_s
    assert 0 < short < long


@pytest.mark.parametrize("kwargs", [dict(gpu_memory_utilization=0.0),
                                    dict(gpu_memory_utilization=1.5), dict(block_size=0)])
def test_bad_inputs_raise(kwargs):
    with pytest.raises(ValueError):
        reference_plan(**kwargs)
    with pytest.raises(ValueError, match="prompt_tokens"):
        plan(model_preset("llama-7b"), get_gpu("h200"), 0, 10)


def test_gpu_lookup():
    assert set(gpu_names()) >= {"a100-80g", "h100-80g", "h200"}
    assert get_gpu("H200").hbm_bytes_per_s == 4.8e12
    assert get_gpu("a100-80g").bf16_flops_per_s == 312e12
    with pytest.raises(ValueError, match="a100-80g, h100-80g, h200"):
        get_gpu("v100")
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_gpu("h200").memory_bytes = 1  # type: ignore[misc]


def test_batch_sizes():
    assert batch_sizes(1) == (1,)
    assert batch_sizes(6) == (1, 2, 4, 6)
    assert batch_sizes(8) == (1, 2, 4, 8)
    assert batch_sizes(0) == ()


def test_an_expected_prefix_hit_shrinks_each_request_and_its_prefill():
    cold = reference_plan()
    warm = reference_plan(prefix_hit_ratio=0.9)
    # 90 % of 2,048 = 1,843 tokens -> 1,840 in whole blocks (115): a request newly takes
    # ceil((2,048 - 1,840 + 256) / 16) = 29 blocks, the prefix's 115 held once for all
    assert (warm.memory.blocks_per_request, warm.memory.cached_prefix_blocks) == (29, 115)
    assert warm.memory.max_concurrent_requests == (warm.memory.num_kv_blocks - 115) // 29
    assert warm.memory.max_concurrent_requests > 4 * cold.memory.max_concurrent_requests
    assert warm.prefill_s < 0.25 * cold.prefill_s
    assert reference_plan(prefix_hit_ratio=0.0) == cold
    with pytest.raises(ValueError, match="prefix_hit_ratio"):
        reference_plan(prefix_hit_ratio=1.0)
