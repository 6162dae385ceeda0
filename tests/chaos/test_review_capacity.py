"""The review's calibration: C is what the baseline saturates at on each scenario's traffic, and
the burst's prompts are long enough that a batched-token budget past the ITL breaks it."""

import pytest

from chaos.review_capacity import replica_capacity_gpu_rps
from chaos.review_fleet import EngineFlags, FleetSpec
from chaos.review_scenarios import (
    LONG_PROMPT_TOKENS,
    OUTPUT_TOKENS,
    PROMPT_TOKENS,
    capacity_gpu_rps,
    scenario_matrix,
    traffic,
)
from chaos.scenario_run import NOMINAL_REPLICA_CAPACITY_GPU_RPS
from chaos.schedule import LengthDist
from engine.config import model_preset
from engine.gpus import get_gpu
from engine.planner import max_batched_tokens_for_itl
from engine.timing_model import StepShape, TimingModel

ITL_S = 0.08


def _c(engine, prompt=PROMPT_TOKENS):
    return replica_capacity_gpu_rps(engine, LengthDist.parse(prompt), LengthDist.parse(OUTPUT_TOKENS))


def test_capacity_follows_the_roofline_and_the_fleet_flags():
    base = _c(EngineFlags())
    # the chaos runs' nominal C for this traffic was measured (bench overload) at 24 req/s:
    # the roofline's saturation is that within the sim's per-step CPU overhead
    assert NOMINAL_REPLICA_CAPACITY_GPU_RPS <= base <= 1.15 * NOMINAL_REPLICA_CAPACITY_GPU_RPS
    assert _c(EngineFlags(step_time_factor=0.8)) == pytest.approx(base / 0.8)
    assert _c(EngineFlags(), LONG_PROMPT_TOKENS) < 0.5 * base  # longer prompts, fewer per s
    assert _c(EngineFlags(max_num_seqs=1)) < 0.5 * base  # one stream at a time
    assert _c(EngineFlags(num_blocks=100)) < 0.5 * base  # a KV pool that holds one request


def test_each_scenario_is_offered_its_own_multiple_of_the_baselines_c():
    fleet = FleetSpec("b", replicas=2)
    matrix = {s.name: s for s in scenario_matrix(quick=True)}
    burst = matrix["burst"]
    c = capacity_gpu_rps(burst, fleet)
    assert c == pytest.approx(2 * _c(EngineFlags(), LONG_PROMPT_TOKENS))
    assert capacity_gpu_rps(matrix["steady"], fleet) == pytest.approx(2 * _c(EngineFlags()))
    specs, _ = traffic(burst, c, seed=0, model="llama-7b")
    start, end, load = burst.burst
    inside = [s for s in specs if start <= s.scheduled_s < end]
    assert load == 1.16 and len(inside) / (end - start) / c == pytest.approx(1.16, rel=0.2)
    # long enough that 1.16 C's backlog (0.16 s of work per second) passes the 1 s TTFT
    assert 0.16 * (end - start) > 1.0
    assert all(LengthDist.parse(LONG_PROMPT_TOKENS).low <= s.num_prompt_tokens for s in specs)
    assert max(s.num_prompt_tokens + s.max_tokens for s in specs) <= 4096  # llama-7b context


def test_the_bursts_prompts_break_the_itl_under_an_oversized_budget_but_not_the_baselines():
    timing = TimingModel(model_preset("llama-7b"), get_gpu("h100-80g"))
    prompt = LengthDist.parse(LONG_PROMPT_TOKENS)
    decoding, context = 8, 8 * 3000
    fits = max_batched_tokens_for_itl(timing, ITL_S, decoding, context, prompt.high)
    assert EngineFlags().max_num_batched_tokens <= fits < (prompt.low + prompt.high) / 2
    # one whole prompt in one step beside the streams (a 16,384-token budget): over the ITL
    whole = timing.step_s(StepShape(prompt.high, decoding, context))
    chunk = timing.step_s(StepShape(EngineFlags().max_num_batched_tokens - decoding, decoding,
                                    context, num_prefill_cached_tokens=prompt.high // 2))
    assert whole > 1.5 * ITL_S and chunk < ITL_S
