"""``kvguard engine --backend sim`` (llama-7b on a modelled H100) over loopback HTTP, and the
graceful SIGTERM shutdown of a replica."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import openai
import pytest
from server_helpers import start_engine, wait_until

SIM_ARGS = ["--backend", "sim", "--model", "llama-7b", "--gpu", "h100-80g", "--time-scale", "1"]


@pytest.fixture(scope="module")
def sim_url():
    with start_engine(SIM_ARGS) as eng:
        yield eng.base_url


def _parse_sse(lines) -> tuple[list[int], list[str], bool]:
    """(generated token ids, finish reasons, saw [DONE]) of SSE lines."""
    ids, reasons, done = [], [], False
    for line in lines:
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            for choice in json.loads(line[6:])["choices"]:
                ids += choice["token_ids"]
                if choice["finish_reason"]:
                    reasons.append(choice["finish_reason"])
    return ids, reasons, done


def test_sim_replica_streams_token_id_prompts(sim_url):
    body = {"model": "llama-7b", "prompt": list(range(300, 340)), "max_tokens": 12,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", sim_url + "/v1/completions", json=body, timeout=30.0) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        ids, reasons, done = _parse_sse(resp.iter_lines())
    assert len(ids) == 12 and reasons == ["length"] and done
    assert all(256 <= t < 32000 for t in ids)


def test_sim_replica_state_and_chat(sim_url):
    with openai.OpenAI(base_url=sim_url + "/v1", api_key="unused", max_retries=0) as client:
        resp = client.chat.completions.create(
            model="llama-7b", messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=4)
    assert resp.usage.completion_tokens == 4 and resp.choices[0].finish_reason == "length"
    state = httpx.get(sim_url + "/kvguard/state").json()
    assert state["backend"] == "sim" and state["model"] == "llama-7b"
    assert state["timing_model"] is not None and state["time_scale"] == 1.0
    assert state["max_model_len"] == 4096 and state["num_total_blocks"] > 1000
    assert state["num_free_blocks"] == state["num_total_blocks"]
    recent = state["iterations"][-1]
    assert recent["num_decode_seqs"] == 1 and recent["duration_s"] > 0


def test_sigterm_drains_then_exits_zero():
    """SIGTERM: new requests get 503 while a long stream is drained, the stream is aborted at
    the shutdown bound and still ends with [DONE], and the process exits 0."""
    args = [*SIM_ARGS, "--shutdown-timeout-s", "2"]
    with start_engine(args) as eng:
        body = {"prompt": [300, 301], "max_tokens": 4000, "ignore_eos": True, "stream": True}
        result: dict = {}
        first_chunk = threading.Event()

        def consume() -> None:
            with httpx.stream("POST", eng.base_url + "/v1/completions", json=body,
                              timeout=30.0) as resp:
                lines = resp.iter_lines()
                for line in lines:
                    if line.startswith("data: "):
                        first_chunk.set()
                        break
                result["rest"] = _parse_sse(lines)

        reader = threading.Thread(target=consume)
        reader.start()
        assert first_chunk.wait(30.0)
        eng.proc.send_signal(signal.SIGTERM)
        refused = wait_until(lambda: httpx.get(eng.base_url + "/health").status_code == 503, 2.0)
        assert refused, "health must turn 503 while draining"
        late = httpx.post(eng.base_url + "/v1/completions", json={"prompt": [1], "max_tokens": 1})
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        reader.join(30.0)
        assert eng.proc.wait(30.0) == 0, eng.output()
    ids, reasons, done = result["rest"]
    assert reasons == ["abort"] and done and 0 < len(ids) < 4000



def test_guard_flag_mounts_the_admission_middleware(tmp_path):
    config = tmp_path / "guard.toml"
    config.write_text('policy = "slo"\n')
    with start_engine([*SIM_ARGS, "--guard", str(config)]) as eng:
        ok = httpx.post(eng.base_url + "/v1/completions", timeout=30.0,
                        json={"prompt": [300, 301], "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert "x-kvguard-queue-ms" in ok.headers  # the guard admitted it
        assert ok.headers["x-request-id"] == ok.json()["id"].removeprefix("cmpl-")
        too_long = httpx.post(eng.base_url + "/v1/completions",
                              json={"prompt": [300], "max_tokens": 5000})
        assert too_long.status_code == 400 and too_long.headers["x-should-retry"] == "false"
