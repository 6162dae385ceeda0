"""Honest outcomes against a real ``kvguard engine --backend sim --guard`` process.

After each scenario the guard's books balance: every offered request ended in exactly one of
completed, canceled, failed, rejected_upstream, rejected (offered = the sum), admitted ones in
completed + canceled + failed + rejected_upstream, nothing held, nothing queued, every KV block
free; and nothing that was cut short counts as completed or as goodput.
"""

import asyncio
import json
import re
import signal
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from server_helpers import start_engine, wait_until  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ENGINE = ["--model", "llama-7b", "--backend", "sim", "--gpu", "h100-80g", "--time-scale", "2"]
ENDS = ("completed", "canceled", "failed", "rejected_upstream")
ABORTED = re.compile(r'"finish_reason":\s*"abort"')
LONG = {"model": "llama-7b", "prompt": [7] * 16, "max_tokens": 3000, "ignore_eos": True}


def write_config(tmp_path: Path, **extra) -> Path:
    config = tmp_path / "guard.toml"
    lines = [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    config.write_text("\n".join(["refresh_interval_s = 0.05", *lines,
                                 "[classes.interactive]", "ttft_s = 60.0", "itl_s = 5.0"]) + "\n")
    return config


def totals(text: str) -> dict[str, float]:
    """Each ``kvguard_requests_*_total`` summed over its labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvguard_requests_") and "_total" in line:
            name = line.split("_total")[0].removeprefix("kvguard_requests_")
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def assert_books_balance(c: dict[str, float]) -> None:
    ended = sum(c.get(k, 0.0) for k in (*ENDS, "rejected"))
    assert c.get("offered", 0.0) == ended, c
    assert c.get("admitted", 0.0) <= sum(c.get(k, 0.0) for k in ENDS), c


def at_rest(client: httpx.Client) -> dict[str, float] | None:
    text = client.get("/kvguard/metrics").text
    held = [ln for ln in text.splitlines() if ln.startswith("kvguard_held_tickets ")]
    queued = [ln for ln in text.splitlines() if ln.startswith("kvguard_queue_length ")]
    state = client.get("/kvguard/state").json()
    if (held and float(held[0].split()[1]) == 0 and queued and float(queued[0].split()[1]) == 0
            and state["num_free_blocks"] == state["num_total_blocks"]):
        return totals(text)
    return None


def test_one_hundred_non_streaming_client_timeouts_are_canceled(tmp_path):
    with start_engine([*ENGINE, "--guard", str(write_config(tmp_path))]) as eng:
        async def timeouts() -> int:
            async with httpx.AsyncClient(base_url=eng.base_url, trust_env=False,
                                         timeout=httpx.Timeout(10.0, read=0.3),
                                         limits=httpx.Limits(max_connections=100)) as client:
                async def one() -> bool:
                    try:
                        await client.post("/v1/completions", json=LONG)
                    except httpx.ReadTimeout:
                        return True
                    return False
                return sum(await asyncio.gather(*(one() for _ in range(100))))

        assert asyncio.run(timeouts()) == 100
        with httpx.Client(base_url=eng.base_url, timeout=10.0, trust_env=False) as client:
            books = wait_until(lambda: at_rest(client), 60.0)
    assert books is not None, "the guard never came to rest"
    assert_books_balance(books)
    assert books["offered"] == 100 and books["canceled"] == 100, books
    assert books.get("failed", 0) == 0 and books.get("completed", 0) == 0


def test_engine_4xx_behind_the_guard_is_rejected_upstream(tmp_path):
    with start_engine([*ENGINE, "--guard", str(write_config(tmp_path))]) as eng:
        with httpx.Client(base_url=eng.base_url, timeout=30.0, trust_env=False) as client:
            # a token id outside the vocabulary: only the engine knows its vocabulary size
            refused = client.post("/v1/completions", json={"prompt": [1, 10**6],
                                                           "max_tokens": 2})
            served = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
            assert refused.status_code == 400 and served.status_code == 200
            books = wait_until(lambda: at_rest(client), 30.0)
    assert books is not None
    assert_books_balance(books)
    assert books["rejected_upstream"] == 1 and books["completed"] == 1, books
    assert books.get("failed", 0) == 0


def test_streams_aborted_at_shutdown_are_never_completed(tmp_path):
    trace = tmp_path / "guard-trace.jsonl"
    config = write_config(tmp_path, trace_path=str(trace))
    with start_engine([*ENGINE, "--guard", str(config), "--shutdown-timeout-s", "1"]) as eng:
        async def streams() -> list[str]:
            async with httpx.AsyncClient(base_url=eng.base_url, timeout=60.0,
                                         trust_env=False) as client:
                first = [asyncio.Event() for _ in range(4)]

                async def one(event) -> str:
                    async with client.stream("POST", "/v1/completions",
                                             json={**LONG, "stream": True}) as response:
                        async for line in response.aiter_lines():
                            event.set()
                            if ABORTED.search(line):
                                return "abort"
                    return "ended"

                tasks = [asyncio.ensure_future(one(e)) for e in first]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first)), 60)
                eng.proc.send_signal(signal.SIGTERM)  # past the 1 s drain: the engine aborts them
                return await asyncio.gather(*tasks)

        ends = asyncio.run(streams())
        eng.proc.wait(timeout=60)
    assert ends == ["abort"] * 4
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    outcomes = sorted(line["outcome"] for line in lines)
    assert len(lines) == 4 and set(outcomes) <= {"failed", "canceled"}, outcomes
    assert not any(line["met_slo"] for line in lines)
