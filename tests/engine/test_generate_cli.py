"""``kvguard generate``: streaming mechanics on the tiny model, and the real CLI on SmolLM2."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.generate_cli import stream_completion
from engine.gguf_loader import ModelFileNotFoundError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_smollm2_tokenizer
from guard.cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    try:
        return load_smollm2_tokenizer()
    except ModelFileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.mark.smollm2
def test_stream_writes_exactly_the_decoded_completion(tokenizer):
    # the tiny random model shares SmolLM2's vocabulary size, so its tokens decode to (odd) text
    engine = LLMEngine.from_preset("tiny", tokenizer=tokenizer, device="cpu", num_blocks=64,
                                   eos_token_ids=())
    out = io.StringIO()
    stats = stream_completion(engine, tokenizer.encode("Hello there"),
                              SamplingParams(max_tokens=12, temperature=0.0), out)
    assert stats["num_output_tokens"] == 12 and stats["finish_reason"] == "length"
    expected = tokenizer.decode(stats["output_token_ids"], skip_special_tokens=True)
    assert out.getvalue() == expected + "\n"
    assert stats["num_prompt_tokens"] == 2 and 0 <= stats["ttft_s"] <= stats["total_s"]


def test_model_without_tokenizer_is_a_clear_error(capsys):
    assert main(["generate", "--model", "tiny", "--device", "cpu", "hi"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err


def test_system_without_chat_is_rejected(capsys):
    assert main(["generate", "--system", "be brief", "hi"]) == 2
    assert "--system needs --chat" in capsys.readouterr().err


@pytest.mark.smollm2
@pytest.mark.slow
def test_cli_answers_paris_greedily(tokenizer):
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.run(
        [sys.executable, "-m", "guard.cli", "generate", "--model", "smollm2-135m", "--chat",
         "--max-tokens", "24", "--temperature", "0", "--device", "cpu", "--stats",
         "What is the capital of France?"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "output tokens, finish=stop" in proc.stderr  # stopped at <|im_end|>, not the limit
