"""The simulated backend: deterministic tokens, exact model time on a virtual clock, real-time
step durations that follow the timing model, and a KV pool sized by the planner."""

import json
import statistics
import subprocess
import sys

import pytest

from engine.config import model_preset
from engine.gpus import get_gpu
from engine.runner import Runner
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.sim_runner import SimRunner, VirtualClock, build_sim_engine
from engine.timing_model import StepShape, TimingModel

LLAMA = model_preset("llama-7b")


def _decode(rid, computed, stop=()):
    return ScheduledSeq(request_id=rid, token_ids=(500,), num_computed_tokens=computed,
                        num_prompt_tokens=10, block_ids=(0,), samples=True,
                        params=SamplingParams(stop_token_ids=stop))


def _runner(seed=0, time_scale=1.0, **kwargs):
    clock = VirtualClock(100.0)
    runner = SimRunner(TimingModel(LLAMA, get_gpu("h100-80g")), time_scale=time_scale,
                       seed=seed, clock=clock, sleep=clock.sleep, spin_s=0.0, **kwargs)
    return runner, clock


def test_sim_runner_is_a_runner_and_waits_exactly_the_scaled_model_time():
    runner, clock = _runner(time_scale=2.5)
    assert isinstance(runner, Runner)
    out = SchedulerOutput(batch_id=0, scheduled=(_decode("a", 100), _decode("b", 300)))
    tokens = runner.execute(out)
    expected = runner.timing.step_s(StepShape(num_decode_seqs=2, num_context_tokens=400))
    assert clock() - 100.0 == pytest.approx(2.5 * expected, rel=1e-12)
    assert set(tokens) == {"a", "b"}
    assert runner.num_steps == 1 and runner.total_predicted_s == pytest.approx(expected)


def test_tokens_are_deterministic_per_seed_request_and_position():
    out = SchedulerOutput(batch_id=0, scheduled=tuple(_decode(f"r{i}", 10 + i) for i in range(50)))
    first, again = _runner(seed=1)[0].execute(out), _runner(seed=1)[0].execute(out)
    other = _runner(seed=2)[0].execute(out)
    assert first == again
    assert first != other
    moved = SchedulerOutput(batch_id=0, scheduled=tuple(
        _decode(f"r{i}", 11 + i) for i in range(50)))
    assert _runner(seed=1)[0].execute(moved) != first


def test_tokens_avoid_eos_and_stop_ids_and_stay_in_range():
    runner, _ = _runner(vocab_size=300, avoid_token_ids=(150,))
    stop = tuple(range(151, 290))  # leaves 150..299 minus stops minus EOS: 290..299
    out = SchedulerOutput(batch_id=0, scheduled=tuple(
        _decode(f"r{i}", i, stop=stop) for i in range(200)))
    tokens = runner.execute(out).values()
    assert all(290 <= t < 300 for t in tokens)


def test_requests_run_to_max_tokens_without_eos():
    clock = VirtualClock()
    engine = build_sim_engine("llama-7b", "h100-80g", clock=clock, sleep=clock.sleep, spin_s=0.0)
    engine.add_request("x", [5] * 40, SamplingParams(max_tokens=9))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step().outputs if o.request_id == "x"]
    assert sum(len(o.new_token_ids) for o in outputs) == 9
    assert outputs[-1].finish_reason == "length"
    assert all(t not in LLAMA.eos_token_ids for o in outputs for t in o.new_token_ids)
    assert clock() == pytest.approx(engine.runner.total_predicted_s)


def test_state_reports_sim_backend_and_timing_model():
    engine = build_sim_engine("llama-7b", "a100-80g", time_scale=0.5)
    state = engine.state()
    assert state["backend"] == "sim" and state["time_scale"] == 0.5
    timing = state["timing_model"]
    assert timing["gpu"]["name"] == "a100-80g"
    assert {"bw_efficiency", "flops_efficiency", "overhead_s", "step_time_prior"} <= set(timing)
    json.dumps(state)


def test_sim_kv_blocks_match_kvguard_plan_json():
    proc = subprocess.run(
        [sys.executable, "-m", "guard.cli", "plan", "--model", "llama-7b", "--gpu", "h100-80g",
         "--prompt-tokens", "2048", "--output-tokens", "256", "--json"],
        capture_output=True, text=True, check=True, timeout=60)
    planned = json.loads(proc.stdout)["num_kv_blocks"]
    engine = build_sim_engine("llama-7b", "h100-80g")
    assert engine.num_total_blocks == planned
    assert engine.state()["num_total_blocks"] == planned


def test_num_blocks_override_sizes_the_pool_and_zero_is_refused_not_ignored():
    assert build_sim_engine("llama-7b", "a100-80g", num_blocks=512).num_total_blocks == 512
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        build_sim_engine("llama-7b", "a100-80g", num_blocks=0)


def test_model_that_does_not_fit_is_a_clear_error():
    with pytest.raises(ValueError, match="does not fit"):
        build_sim_engine("llama-7b", "a100-80g", gpu_memory_utilization=0.1)


def test_real_time_step_durations_follow_the_timing_model():
    """~30 ms steps in real time: the sim never runs faster than the model, and the median
    step is within 10 % of it (median over 12 decode steps, robust on a loaded machine)."""
    scale = 6.0
    engine = build_sim_engine("llama-7b", "h100-80g", time_scale=scale)
    for i in range(4):
        engine.add_request(f"r{i}", [7] * 64, SamplingParams(max_tokens=14))
    ratios = []
    while engine.has_unfinished_requests():
        rec = engine.step().iteration
        if rec is None or rec.num_prefill_tokens:
            continue
        predicted = scale * engine.runner.timing.predict_s(0, rec.num_decode_seqs,
                                                          rec.num_context_tokens)
        assert 0.02 < predicted < 0.05
        ratios.append(rec.duration_s / predicted)
    assert len(ratios) >= 10
    assert min(ratios) >= 1.0
    assert statistics.median(ratios) <= 1.10


def test_cached_prefix_tokens_are_priced_as_attention_reads_not_prefill():
    def prefill_steps_s(enable_prefix_caching: bool) -> list[float]:
        clock = VirtualClock()
        engine = build_sim_engine("llama-7b", clock=clock, sleep=clock.sleep, spin_s=0.0,
                                  num_blocks=512, enable_prefix_caching=enable_prefix_caching)
        prefix = [1000 + i for i in range(1024)]
        durations = []
        for rid, suffix in (("a", [7] * 10), ("b", [9] * 10)):
            engine.add_request(rid, prefix + suffix, SamplingParams(max_tokens=1))
            durations.append(engine.step().iteration.duration_s)
        return durations

    first, second = prefill_steps_s(True)
    timing = TimingModel(LLAMA, get_gpu("h100-80g"))
    new = 10  # 64 cached blocks of 16: only the suffix is computed, over 1024 cached tokens
    expected = timing.step_s(StepShape(num_prefill_tokens=new, num_prefill_cached_tokens=1024,
                                       num_prefill_attention_pairs=new * 1024 + new * 11 // 2,
                                       num_sampled_seqs=1))
    assert second == pytest.approx(expected, rel=1e-9)
    assert second < first / 5
    assert prefill_steps_s(False) == [pytest.approx(first)] * 2
