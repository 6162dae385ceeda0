"""The paged, batched, chunked, preempting engine generates exactly the reference's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.reference import reference_greedy
from engine.sampling_params import SamplingParams


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Small models run faster on one thread, and far faster on a CPU shared with other jobs."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_engine(**overrides) -> LLMEngine:
    options = dict(device="cpu", dtype="float32", check_invariants=True)
    return LLMEngine.from_preset("tiny", **(options | overrides))


def reference(engine: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    model = engine.runner.model
    return reference_greedy(model.config, model.hf_state_dict(), prompt, max_tokens)


def run(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int], int]]],
        max_steps: int = 500) -> dict[str, list[int]]:
    """Add requests at the given step numbers; step until all finish; tokens per request."""
    tokens: dict[str, list[int]] = {}
    for step in range(max_steps):
        for request_id, prompt, max_tokens in arrivals.get(step, []):
            engine.add_request(request_id, prompt, SamplingParams.greedy_params(max_tokens))
            tokens[request_id] = []
        if step > max(arrivals) and not engine.has_unfinished_requests():
            return tokens
        for out in engine.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    raise AssertionError("engine did not finish")


def prompt_of(length: int, salt: int) -> list[int]:
    return [(salt * 7919 + i * 104729) % 49152 for i in range(length)]


def assert_all_blocks_free(engine: LLMEngine) -> None:
    assert engine.num_free_blocks == engine.num_total_blocks
    assert all(count == 0 for count in engine.block_manager.pool.ref_counts)
    assert not engine.block_manager.holders()
    engine.check_invariants()


MIXED = {
    0: [("a", prompt_of(1, 1), 10), ("b", prompt_of(23, 2), 9)],
    1: [("c", prompt_of(5, 3), 12)],
    3: [("d", prompt_of(40, 4), 8), ("e", prompt_of(16, 5), 11)],
    6: [("f", prompt_of(9, 6), 7)],
}


@pytest.mark.parametrize("max_group_tokens", [None, 24], ids=["one-group", "grouped"])
def test_mixed_batch_with_chunking_and_preemption_matches_reference(max_group_tokens):
    engine = tiny_engine(block_size=4, num_blocks=20, max_num_batched_tokens=16)
    engine.runner.max_group_tokens = max_group_tokens  # attention over groups of sequences
    got = run(engine, MIXED)
    assert engine.num_preemptions > 0, "the pool should be small enough to force preemption"
    for request_id, prompt, max_tokens in (r for reqs in MIXED.values() for r in reqs):
        assert got[request_id] == reference(engine, prompt, max_tokens), request_id
    assert_all_blocks_free(engine)


def test_without_chunked_prefill_matches_reference():
    engine = tiny_engine(block_size=8, num_blocks=64, max_model_len=128,
                         max_num_batched_tokens=128, enable_chunked_prefill=False, max_num_seqs=3)
    got = run(engine, MIXED)
    for request_id, prompt, max_tokens in (r for reqs in MIXED.values() for r in reqs):
        assert got[request_id] == reference(engine, prompt, max_tokens), request_id
    assert_all_blocks_free(engine)


def test_priority_policy_with_preemption_matches_reference():
    engine = tiny_engine(block_size=4, num_blocks=16, max_num_batched_tokens=24, policy="priority")
    prompts = {f"r{i}": prompt_of(8 + 5 * i, 10 + i) for i in range(5)}
    for i, (request_id, prompt) in enumerate(prompts.items()):
        engine.add_request(request_id, prompt, SamplingParams.greedy_params(9), priority=-i)
    got = {request_id: [] for request_id in prompts}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            got[out.request_id].extend(out.new_token_ids)
    assert engine.num_preemptions > 0
    for request_id, prompt in prompts.items():
        assert got[request_id] == reference(engine, prompt, 9), request_id
    assert_all_blocks_free(engine)


def test_continuation_depends_on_early_context():
    """Guards the test above against a model whose output ignores attention."""
    engine = tiny_engine(num_blocks=16)
    prompt = prompt_of(20, 7)
    changed = [prompt[0] + 1] + prompt[1:]
    got = run(engine, {0: [("x", prompt, 6), ("y", changed, 6)]})
    assert got["x"] != got["y"]
    assert got["y"] == reference(engine, changed, 6)


def _smollm2_loader():
    try:
        from engine.gguf_loader import load_smollm2
    except ImportError as exc:
        pytest.skip(f"engine.gguf_loader is not available yet: {exc}")
    return load_smollm2


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_matches_reference_and_knows_paris():
    _smollm2_loader()
    engine = LLMEngine.from_preset("smollm2-135m", device="cpu", dtype="float32",
                                   num_blocks=32, max_num_batched_tokens=8,
                                   check_invariants=True)
    texts = {"p0": "The capital of France is", "p1": "1, 2, 3, 4,", "p2": "Once upon a time"}
    prompts = {k: engine.tokenizer.encode(text) for k, text in texts.items()}
    got = run(engine, {0: [("p0", prompts["p0"], 6), ("p1", prompts["p1"], 6)],
                       2: [("p2", prompts["p2"], 6)]})
    assert engine.tokenizer.decode(got["p0"]).startswith(" Paris")
    eos = set(engine.config.model.eos_token_ids)
    for request_id, prompt in prompts.items():
        want = reference(engine, prompt, 6)
        cut = next((i + 1 for i, t in enumerate(want) if t in eos), len(want))
        assert got[request_id] == want[:cut], request_id
    assert_all_blocks_free(engine)


# ---- engine scenarios: aborts, state, seeded sampling, and the runner protocol -------------

def test_abort_while_waiting_mid_prefill_and_mid_decode_frees_everything():
    engine = tiny_engine(block_size=4, num_blocks=32, max_num_batched_tokens=8, max_num_seqs=2)
    engine.add_request("decoding", prompt_of(5, 1), SamplingParams.greedy_params(20))
    engine.add_request("prefilling", prompt_of(30, 2), SamplingParams.greedy_params(20))
    engine.add_request("waiting", prompt_of(3, 3), SamplingParams.greedy_params(20))
    engine.step()
    engine.step()
    state = engine.state()
    running = {s["request_id"]: s for s in state["running"]}
    assert running["decoding"]["num_output_tokens"] == 2
    assert 0 < running["prefilling"]["num_prefill_tokens_remaining"] < 30
    assert [s["request_id"] for s in state["waiting"]] == ["waiting"]
    for request_id in ("waiting", "prefilling", "decoding"):
        assert engine.abort_request(request_id)
        engine.check_invariants()
    assert_all_blocks_free(engine)
    result = engine.step()
    assert result.iteration is None
    assert {(o.request_id, o.finished, o.finish_reason) for o in result.outputs} == {
        ("waiting", True, "abort"), ("prefilling", True, "abort"), ("decoding", True, "abort")}
    assert not engine.has_unfinished_requests()


def test_state_and_iteration_records_are_exact():
    clock_s = iter(float(i) for i in range(1000))
    engine = LLMEngine.from_preset("tiny", device="cpu", block_size=4, num_blocks=32,
                                   max_num_batched_tokens=6, clock=lambda: next(clock_s))
    engine.add_request("a", prompt_of(4, 1), SamplingParams.greedy_params(5))
    engine.add_request("b", prompt_of(5, 2), SamplingParams.greedy_params(5))
    records = [engine.step().iteration for _ in range(3)]
    assert [(r.batch_id, r.num_prefill_tokens, r.num_decode_seqs, r.num_context_tokens)
            for r in records] == [(0, 6, 0, 0), (1, 3, 1, 4), (2, 0, 2, 10)]
    assert all(r.duration_s == 1.0 and r.end_s == 3.0 + 2 * i
               for i, r in enumerate(records))
    state = engine.state()
    assert state["num_free_blocks"] == 32 - 2 - 2 and state["step_count"] == 3
    assert state["backend"] == "torch" and state["model"] == "tiny"
    assert state["running"][0] == {
        "request_id": "a", "num_prompt_tokens": 4, "num_output_tokens": 3, "max_tokens": 5,
        "num_context_tokens": 7, "num_prefill_tokens_remaining": 0, "num_blocks": 2,
        "num_cached_tokens": 0, "priority": 0}
    assert [it["batch_id"] for it in state["iterations"]] == [0, 1, 2]


def test_seeded_sampling_does_not_depend_on_batch_company_or_preemption():
    params = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=42)
    got = {}
    for scenario, company, num_blocks in (("alone", 0, 32), ("crowded", 3, 32),
                                          ("preempted", 2, 8)):
        # priority policy: "seeded" is the least important, so it is the one preempted
        engine = tiny_engine(block_size=4, num_blocks=num_blocks, policy="priority")
        engine.add_request("seeded", prompt_of(9, 9), params, priority=5)
        for i in range(company):
            engine.add_request(f"other{i}", prompt_of(7 + i, i), SamplingParams(max_tokens=6))
        tokens = []
        while engine.has_unfinished_requests():
            step_tokens = [t for o in engine.step().outputs if o.request_id == "seeded"
                           for t in o.new_token_ids]
            seq = engine.scheduler.get("seeded")
            if seq is not None and seq.num_preemptions and not tokens:
                raise AssertionError("preempted before it sampled: the test proves nothing")
            tokens += step_tokens
        got[scenario] = tokens
        assert (engine.num_preemptions > 0) == (scenario == "preempted")
    assert got["alone"] == got["crowded"] == got["preempted"] and len(got["alone"]) == 6


def test_stop_string_through_the_detokenize_callback():
    engine = tiny_engine(num_blocks=32)
    prompt = prompt_of(6, 4)
    want = reference(engine, prompt, 8)
    engine.scheduler.detokenize = lambda ids: " ".join(map(str, ids))
    engine.add_request("s", prompt, SamplingParams.greedy_params(8, stop=(str(want[2]),)))
    outs = [o for _ in range(8) for o in engine.step().outputs]
    assert [t for o in outs for t in o.new_token_ids] == want[:3]
    assert (outs[-1].finished, outs[-1].finish_reason) == (True, "stop")


class CountingRunner:
    """A runner that computes nothing: the protocol the simulated backend implements."""

    backend = "fake"
    timing_model = {"kind": "constant"}
    time_scale = 2.0

    def __init__(self) -> None:
        self.outputs = []

    def execute(self, scheduler_output):
        self.outputs.append(scheduler_output)
        return {e.request_id: 7 for e in scheduler_output.scheduled if e.samples}


def test_engine_drives_any_runner_of_the_protocol():
    from engine.runner import Runner

    runner = CountingRunner()
    assert isinstance(runner, Runner)
    engine = LLMEngine.from_preset("llama-7b", runner=runner, num_blocks=10, check_invariants=True)
    engine.add_request("a", list(range(20)), SamplingParams(max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert [o.num_scheduled_tokens for o in runner.outputs] == [20, 1, 1]
    state = engine.state()
    assert (state["backend"], state["timing_model"], state["time_scale"]) == (
        "fake", {"kind": "constant"}, 2.0)
    assert state["num_total_blocks"] == 10 and state["max_model_len"] == 4096


# ---- the attention function alone ----------------------------------------------------------

@pytest.mark.parametrize("max_group_tokens", [None, 20])
def test_paged_attention_equals_dense_causal_attention(max_group_tokens):
    from engine.attention import build_metadata, paged_attention

    gen = torch.Generator().manual_seed(0)
    block_size, num_kv_heads, num_heads, head_dim = 4, 2, 4, 8
    # (cached tokens, new tokens): two decodes, a fresh prefill, a chunk after a prefix, decode
    shapes = [(5, 1), (9, 1), (0, 6), (7, 3), (3, 1)]
    tables = [[9, 2, 7], [0, 11, 4], [3, 8], [1, 10, 6], [5]]
    k_cache = torch.randn(12, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(12, block_size, num_kv_heads, head_dim, generator=gen)
    total = sum(n for _, n in shapes)
    q = torch.randn(total, num_heads, head_dim, generator=gen)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen)
    dense_k, dense_v = _dense_histories(k_cache, v_cache, tables, shapes, k, v, block_size)
    meta = build_metadata([n for _, n in shapes], [c + n for c, n in shapes], tables,
                          block_size, torch.device("cpu"), max_group_tokens)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale=head_dim ** -0.5)
    start = 0
    for b, (cached, new) in enumerate(shapes):
        want = _dense_attention(q[start : start + new], dense_k[b], dense_v[b], cached)
        torch.testing.assert_close(out[start : start + new], want, rtol=1e-5, atol=1e-5)
        start += new
    if max_group_tokens:
        assert len(meta.groups) > 3


@pytest.mark.parametrize("table, first_block", [([4, 5, 6], 4), ((4, 5, 6), 4),
                                                 ([6, 4, 5], None), ((4, 6, 7), None)])
@pytest.mark.parametrize("cached, new", [(9, 1), (5, 4), (0, 7)])
def test_one_sequence_on_consecutive_blocks_reads_a_view_with_identical_results(
        table, first_block, cached, new):
    import dataclasses

    from engine.attention import build_metadata, paged_attention

    gen = torch.Generator().manual_seed(1)
    block_size, num_kv_heads, num_heads, head_dim = 4, 2, 4, 8
    caches = [torch.randn(8, block_size, num_kv_heads, head_dim, generator=gen) for _ in "kv"]
    q = torch.randn(new, num_heads, head_dim, generator=gen)
    k = torch.randn(new, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(new, num_kv_heads, head_dim, generator=gen)
    meta = build_metadata([new], [cached + new], [table], block_size, torch.device("cpu"))
    assert meta.groups[0].first_block == first_block
    out = paged_attention(q, k, v, *caches, meta, scale=head_dim ** -0.5)
    gathered = dataclasses.replace(meta, groups=(dataclasses.replace(meta.groups[0],
                                                                     first_block=None),))
    assert torch.equal(out, paged_attention(q, k, v, *caches, gathered, scale=head_dim ** -0.5))
    dense_k, dense_v = _dense_histories(*caches, [table], [(cached, new)], k, v, block_size)
    want = _dense_attention(q, dense_k[0], dense_v[0], cached)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def _dense_histories(k_cache, v_cache, tables, shapes, k, v, block_size):
    """Each sequence's full K/V: its cached prefix read slot by slot, then its new tokens."""
    keys, values, start = [], [], 0
    for table, (cached, new) in zip(tables, shapes, strict=True):
        slots = [(table[p // block_size], p % block_size) for p in range(cached)]
        prefix_k = [k_cache[b, o] for b, o in slots]
        prefix_v = [v_cache[b, o] for b, o in slots]
        keys.append(torch.stack(prefix_k + list(k[start : start + new])))
        values.append(torch.stack(prefix_v + list(v[start : start + new])))
        start += new
    return keys, values


def _dense_attention(q, keys, values, num_cached):
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) / q.shape[-1] ** 0.5
    allowed = torch.arange(keys.shape[0])[None, :] <= num_cached + torch.arange(q.shape[0])[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, values)
