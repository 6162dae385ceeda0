"""SIGTERM to ``kvguard engine --guard`` (a real process): the guard stops admitting first (503
``shutting_down`` with Retry-After, ``/health`` 503), the stream it admitted runs to its end,
then the engine drains and the process exits 0."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from server_helpers import start_engine, wait_until  # noqa: E402

pytestmark = pytest.mark.slow

SIM_ARGS = ["--backend", "sim", "--model", "llama-7b", "--gpu", "h100-80g", "--time-scale", "1"]
NUM_TOKENS = 150  # ~1.5 s of sim decode at batch 1: long enough to SIGTERM in the middle


def _stream(base_url: str, first_chunk: threading.Event, result: dict) -> None:
    body = {"prompt": [300, 301], "max_tokens": NUM_TOKENS, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60.0,
                      trust_env=False) as resp:
        ids, reasons, done = [], [], False
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                first_chunk.set()
                for choice in json.loads(line[6:])["choices"]:
                    ids += choice["token_ids"]
                    reasons += [choice["finish_reason"]] if choice["finish_reason"] else []
        result.update(status=resp.status_code, ids=ids, reasons=reasons, done=done)


def test_sigterm_stops_the_guard_first_and_lets_admitted_streams_finish(tmp_path):
    config = tmp_path / "guard.toml"
    config.write_text('policy = "slo"\n')
    with start_engine([*SIM_ARGS, "--guard", str(config), "--shutdown-timeout-s", "30"]) as eng:
        result: dict = {}
        first_chunk = threading.Event()
        reader = threading.Thread(target=_stream, args=(eng.base_url, first_chunk, result))
        reader.start()
        assert first_chunk.wait(30.0)
        eng.proc.send_signal(signal.SIGTERM)
        health = wait_until(
            lambda: (r := httpx.get(eng.base_url + "/health", trust_env=False)).status_code
            == 503 and r, 10.0)
        assert health, "the guard's /health must turn 503 while it drains"
        late = httpx.post(eng.base_url + "/v1/completions", trust_env=False, timeout=30.0,
                          json={"prompt": [1, 2], "max_tokens": 1})
        reader.join(60.0)
        assert eng.proc.wait(60.0) == 0, eng.output()
    assert late.status_code == 503, late.text
    assert late.headers["x-kvguard-reason"] == "shutting_down"
    assert late.json()["error"]["code"] == "shutting_down"
    assert int(late.headers["retry-after"]) >= 1 and late.headers["x-should-retry"] == "true"
    assert result["status"] == 200 and result["done"]
    assert result["reasons"] == ["length"] and len(result["ids"]) == NUM_TOKENS
    assert "Traceback" not in eng.output()
