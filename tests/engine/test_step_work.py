"""Each step's per-request work (the shares cost accounting divides a step's time by)."""

import io
import json

from engine.sampling_params import SamplingParams
from engine.sim_runner import VirtualClock, build_sim_engine
from engine.trace import TraceWriter


def _engine(**overrides):
    clock = VirtualClock(10.0)
    engine = build_sim_engine("llama-7b", "h100-80g", clock=clock, sleep=clock.sleep, spin_s=0.0,
                              **overrides)
    return engine


def test_prefill_then_decode_work_per_request():
    engine = _engine(max_num_batched_tokens=64)
    engine.add_request("a", list(range(1, 41)), SamplingParams(max_tokens=3))
    engine.add_request("b", list(range(1, 11)), SamplingParams(max_tokens=2))
    first = engine.step()
    assert [(w.request_id, w.num_prefill_tokens, w.num_decode_tokens, w.num_kv_read_tokens)
            for w in first.work] == [("a", 40, 0, 0), ("b", 10, 0, 0)]
    assert first.start_s is not None and first.start_s < first.iteration.end_s
    second = engine.step()
    assert [(w.request_id, w.num_prefill_tokens, w.num_decode_tokens, w.num_kv_read_tokens)
            for w in second.work] == [("a", 0, 1, 40), ("b", 0, 1, 10)]
    assert all(w.num_recomputed_tokens == 0 for w in first.work + second.work)


def test_recomputation_after_preemption_is_marked():
    # 4 blocks of 16: two requests that each grow past two blocks force a preemption
    engine = _engine(num_blocks=4, block_size=16, max_num_batched_tokens=128)
    engine.add_request("a", list(range(1, 31)), SamplingParams(max_tokens=20))
    engine.add_request("b", list(range(1, 31)), SamplingParams(max_tokens=20))
    recomputed = 0
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        recomputed += sum(w.num_recomputed_tokens for w in engine.step().work)
    assert engine.num_preemptions == 1
    # b lost its KV holding 32 computed tokens + 1 sampled; its first block (16 tokens) survived
    # in the prefix cache, so tokens 16..31 are computed again (token 32 never was)
    assert recomputed == 16


def test_trace_writes_one_step_line():
    engine = _engine()
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=1))
    out = io.StringIO()
    TraceWriter(out).write_step(engine.step())
    TraceWriter(out).write_step(engine.step())  # nothing scheduled: no line
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert len(lines) == 1
    assert lines[0]["source"] == "engine_step" and lines[0]["work"] == [["a", 3, 0, 0, 0]]
