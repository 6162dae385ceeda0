"""``kvguard bench engine`` smoke tests on the tiny preset (numbers are printed, not asserted)."""

from __future__ import annotations

import argparse
import re
import sys

import pytest
import torch

from chaos.bench import engine as bench
from chaos.bench.engine import BenchRequest, RunResult, Workload


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    return parser.parse_args(list(argv))


def table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in text.splitlines() if re.match(r"\| \d+ \|", line)]


def test_quick_bench_without_transformers_prints_our_rows(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    assert bench.run(bench_args("--quick", "--model", "tiny")) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert [r[0] for r in rows] == ["1", "4", "16"]
    for row in rows:
        assert float(row[1]) > 0 and float(row[2]) > 0  # our tok/s and mean step ms
        assert row[3:] == ["skipped", "skipped", "-", "-"]
    assert "reference: skipped (transformers is not installed" in out
    assert re.search(r"roofline at concurrency 1: [\d.]+ MB of weights / [\d.]+ GB/s", out)
    assert "8 requests (seed 0)" in out


@pytest.mark.slow
@pytest.mark.cpu_heavy  # torch on every core
def test_quick_bench_with_transformers_agrees_greedily(capsys):
    pytest.importorskip("transformers")
    assert bench.run(bench_args("--quick", "--model", "tiny", "--concurrency", "1,4")) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert [r[0] for r in rows] == ["1", "4"]
    assert all(r[5].endswith("x") and r[6].endswith("x") and float(r[3]) > 0 for r in rows)
    # same weights, both greedy, batch 1: token-for-token identical
    assert "identical to transformers at concurrency 1: 8/8 requests" in out


def test_workload_is_seeded_and_in_range():
    workload = Workload(num_requests=20, min_prompt_tokens=5, max_prompt_tokens=9,
                        min_output_tokens=2, max_output_tokens=3, seed=7)
    requests = workload.requests(min_token_id=17, vocab_size=100)
    assert requests == workload.requests(min_token_id=17, vocab_size=100)
    assert requests != Workload(num_requests=20, min_prompt_tokens=5, max_prompt_tokens=9,
                                min_output_tokens=2, max_output_tokens=3,
                                seed=8).requests(17, 100)
    assert all(5 <= len(r.prompt_token_ids) <= 9 and 2 <= r.max_tokens <= 3 for r in requests)
    assert all(17 <= t < 100 for r in requests for t in r.prompt_token_ids)
    assert len({r.request_id for r in requests}) == 20
    with pytest.raises(ValueError, match="min_output_tokens"):
        Workload(min_output_tokens=10, max_output_tokens=5)


def test_run_engine_counts_exactly_the_requested_tokens():
    from engine.llm_engine import LLMEngine

    engine = LLMEngine.from_preset("tiny", device="cpu", num_blocks=32)
    requests = [BenchRequest(f"r{i}", (20 + i,) * (3 + i), 2 + i) for i in range(5)]
    result = bench.run_engine(engine, requests, concurrency=2)
    assert result.num_output_tokens == sum(r.max_tokens for r in requests)
    assert {k: len(v) for k, v in result.outputs.items()} == {f"r{i}": 2 + i for i in range(5)}
    assert result.num_steps >= max(r.max_tokens for r in requests)
    assert not engine.has_unfinished_requests() and engine.num_free_blocks == 32


def test_table_and_weight_bytes():
    ours = RunResult("kvguard", 16, 300, 2.0, 10, 0.2, 0.1, {}, cpu_s=1.5)
    ref = RunResult("transformers", 16, 300, 6.0, 10, 0.6, None, {}, cpu_s=3.0)
    table = bench.format_table([(ours, ref)])
    assert table_rows(table) == [["16", "150.0", "200.0", "50.0", "600.0", "3.00x", "2.00x"]]
    embed = torch.zeros(10, 4)
    assert bench.weight_bytes({"a": embed, "tied": embed, "b": torch.zeros(3)}) == 40 * 4 + 12
