"""The GPU meter: roofline work per step, memory split, modelled power and energy, exported."""

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from engine.config import model_preset
from engine.gpu_meter import GpuMeter, MemorySplit, nvml_power, shape_of
from engine.gpus import get_gpu
from engine.metrics import EngineMetrics
from engine.outputs import RequestWork
from engine.planner import plan_memory
from engine.timing_model import StepShape, step_cost

MODEL = model_preset("llama-7b")
GPU = get_gpu("h100-80g")
DECODE = (RequestWork("a", 0, 1, 100), RequestWork("b", 0, 1, 300))


class Clock:
    now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _meter(clock=None):
    memory = MemorySplit.plan(MODEL, 1000, 16, 2048, 256)
    return GpuMeter(MODEL, GPU, memory, clock=clock or Clock())


def test_work_is_the_roofline_count_of_the_steps_shape():
    meter = _meter()
    meter.on_step(DECODE, 0.01)
    expected = step_cost(MODEL, StepShape(num_decode_seqs=2, num_context_tokens=400))
    assert meter.flops == expected.flops and meter.hbm_bytes == expected.bytes_moved
    assert shape_of((RequestWork("p", 10, 0, 6),)).prefill_attention_pairs() == 10 * 6 + 55


def test_memory_split_matches_the_planner():
    plan = plan_memory(MODEL, GPU, 1, 1)
    split = MemorySplit.plan(MODEL, plan.num_kv_blocks, 16, 2048, 256)
    assert split.weights_bytes == plan.weight_bytes
    assert split.workspace_bytes == plan.activation_bytes
    assert split.reserve_bytes == plan.reserve_bytes
    assert split.kv_bytes == plan.num_kv_blocks * plan.kv_bytes_per_block


def test_modelled_energy_is_idle_over_wall_time_plus_each_steps_utilisation():
    clock = Clock()
    meter = _meter(clock)
    assert meter.source == "modelled"
    cost = step_cost(MODEL, shape_of(DECODE))
    roofline_s = max(cost.bytes_moved / GPU.hbm_bytes_per_s, cost.flops / GPU.bf16_flops_per_s)
    meter.on_step(DECODE, 2 * roofline_s)  # half utilised
    clock.now_s = 10.0
    half = (GPU.max_power_w - GPU.idle_power_w) * 0.5
    assert meter.power_w() == pytest.approx(GPU.idle_power_w + half)
    assert meter.energy_j() == pytest.approx(GPU.idle_power_w * 10 + half * 2 * roofline_s)
    meter.on_step(DECODE, roofline_s / 10)  # faster than the roofline: capped at full power
    assert meter.power_w() == pytest.approx(GPU.max_power_w)


def test_no_cuda_means_no_nvml_reading():
    assert nvml_power() is None  # this machine has no GPU: power is modelled


def test_exported_with_the_source_label():
    metrics = EngineMetrics(CollectorRegistry(), "m")
    meter = _meter()
    metrics.attach_gpu_meter(meter)
    meter.on_step(DECODE, 0.01)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    assert families["kvguard_engine_model_flops"].samples[0].value == meter.flops
    assert families["kvguard_engine_hbm_bytes"].samples[0].value == meter.hbm_bytes
    kinds = {s.labels["kind"]: s.value for s in families["kvguard_engine_memory_bytes"].samples}
    assert kinds == {k: float(v) for k, v in meter.memory.as_dict().items()}
    assert families["kvguard_engine_power_watts"].samples[0].labels["source"] == "modelled"
    assert families["kvguard_engine_energy_joules"].samples[0].labels["source"] == "modelled"


def test_power_figures_are_checked():
    from engine.gpus import GPUSpec

    with pytest.raises(ValueError, match="idle_power_w"):
        GPUSpec("x", "x", 1e12, 1e14, 1 << 30, max_power_w=100.0, idle_power_w=200.0)
