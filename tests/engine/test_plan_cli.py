"""``kvguard plan``: JSON over a real subprocess, the human table, --measure."""

import json
import subprocess
import sys

import pytest

from guard.cli import main

PLAN = ["plan", "--model", "llama-7b", "--gpu", "h100-80g", "--prompt-tokens", "2048",
        "--output-tokens", "256"]


def test_plan_json_subprocess_parses():
    proc = subprocess.run([sys.executable, "-m", "guard.cli", *PLAN, "--json"],
                          capture_output=True, text=True, check=True, timeout=60)
    data = json.loads(proc.stdout)
    assert data["kv_bytes_per_token"] == 131_072
    assert data["kv_bytes_per_request"] == 301_989_888
    assert data["weight_bytes"] == 2 * 7_241_732_096
    assert data["num_kv_blocks"] > 0
    assert data["max_concurrent_requests"] == data["num_kv_blocks"] // 144
    rows = data["roofline"]
    assert rows[0]["batch_size"] == 1 and rows[0]["bound"] == "memory"
    assert rows[-1]["batch_size"] == data["max_concurrent_requests"]
    assert {"bytes_moved", "flops", "arithmetic_intensity", "predicted_step_s",
            "tokens_per_s"} <= set(rows[0])
    assert data["timing_model"]["gpu"]["name"] == "h100-80g"


def test_plan_human_table_has_units(capsys):
    assert main(PLAN) == 0
    out = capsys.readouterr().out
    assert "131,072 B (128 KiB)" in out
    assert "288.0 MiB (301,989,888 B, 144 blocks)" in out
    assert "max concurrent requests" in out
    assert "predicted ms" in out and "tokens/s" in out


def test_options_change_the_plan(capsys):
    assert main(PLAN + ["--json", "--gpu-memory-utilization", "0.5", "--block-size", "32"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["block_size"] == 32 and data["blocks_per_request"] == 72
    assert data["gpu_memory_utilization"] == 0.5


def test_unknown_gpu_is_a_clear_error(capsys):
    assert main(["plan", "--gpu", "v100"]) == 2
    assert "valid names: a100-80g, h100-80g, h200" in capsys.readouterr().err


def test_measure_without_cuda_exits_2(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert main(PLAN + ["--measure"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_measure_decode_steps_runs_the_torch_engine_on_cpu():
    from engine.plan_cli import measure_decode_steps

    rows = measure_decode_steps("tiny", "cpu", "float32", [1, 2], prompt_tokens=20, num_steps=3)
    assert [b for b, _, _ in rows] == [1, 2]
    for _, context, seconds in rows:
        assert 20 <= context <= 23 and seconds > 0


def test_itl_recommends_the_largest_token_budget_whose_step_fits(capsys):
    from engine.config import model_preset
    from engine.gpus import get_gpu
    from engine.planner import max_batched_tokens_for_itl
    from engine.timing_model import StepShape, TimingModel

    timing = TimingModel(model_preset("llama-7b"), get_gpu("a100-80g"))
    budget = max_batched_tokens_for_itl(timing, 0.08, 16, 400, 270)

    def step_s(num_prefill):
        return timing.step_s(StepShape(num_prefill_tokens=num_prefill, num_decode_seqs=16,
                                       num_context_tokens=16 * 400,
                                       num_prefill_cached_tokens=max(0, 270 - num_prefill)))

    assert step_s(budget - 16) <= 0.08 < step_s(budget - 16 + 1)
    assert max_batched_tokens_for_itl(timing, 0.001, 16, 400, 270) == 0  # decode alone over it
    with pytest.raises(ValueError):
        max_batched_tokens_for_itl(timing, 0.0, 16, 400, 270)
    assert main([*PLAN[:3], "--gpu", "a100-80g", "--prompt-tokens", "270", "--output-tokens",
                 "128", "--itl-ms", "80", "--max-num-batched-tokens", "2048", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = data["max_num_batched_tokens_for_itl"]
    assert data["itl_s"] == 0.08 and rows and all(r["batch_size"] <= 256 for r in rows)
    assert main([*PLAN[:3], "--gpu", "a100-80g", "--prompt-tokens", "270", "--output-tokens",
                 "128", "--itl-ms", "80", "--max-num-batched-tokens", "2048"]) == 0
    assert "WARNING: --max-num-batched-tokens 2048 stretches gaps past 80 ms" in \
        capsys.readouterr().out
