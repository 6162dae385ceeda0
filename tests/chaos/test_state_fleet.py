"""The state-only fleet over real loopback HTTP: streams, state documents a guard reads, and
replicas that join and leave while it runs."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from chaos.state_fleet import StateFleet, StateFleetConfig, stream_phase_of
from guard.replicas.load_state import LoadState


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_streamed_completion_and_the_state_it_leaves():
    async def main():
        fleet = StateFleet(StateFleetConfig(tick_s=0.002))
        await fleet.start(2)
        try:
            url = fleet.urls["replica-0"]
            async with httpx.AsyncClient(trust_env=False) as client:
                body = {"model": "llama-7b", "prompt": list(range(100)), "max_tokens": 5,
                        "stream": True, "stream_options": {"include_usage": True}}
                events = []
                async with client.stream("POST", url + "/v1/completions", json=body,
                                         headers={"x-request-id": "req-1"}) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                assert events[-1] == "[DONE]"
                assert sum('"text"' in e for e in events) == 5
                assert '"completion_tokens": 5' in events[-2]
                state = (await client.get(url + "/kvguard/state")).json()
                assert state["running"] == [] and state["num_free_blocks"] == \
                    state["num_total_blocks"]
                assert state["iterations"][0]["num_prefill_tokens"] == 100
                compact = (await client.get(url + "/kvguard/state",
                                            params={"compact": "1"})).json()
                assert compact["running_columns"]["request_id"] == []
                snapshot = LoadState().update_from_kvguard_state("replica-0", compact, 0.0)
                assert snapshot.num_total_blocks == state["num_total_blocks"]
                plain = await client.post(fleet.urls["replica-1"] + "/v1/chat/completions",
                                          json={"messages": [{"role": "user",
                                                              "content": "hi there"}],
                                                "max_tokens": 3})
                assert plain.json()["usage"]["completion_tokens"] == 3
        finally:
            await fleet.stop()
    run(main())


def test_replicas_join_and_leave_while_it_runs():
    async def main():
        fleet = StateFleet(StateFleetConfig(tick_s=0.002))
        await fleet.start(1)
        try:
            async with httpx.AsyncClient(trust_env=False) as client:
                joined = await fleet.add_replica()
                assert (await client.get(fleet.urls[joined] + "/health")).status_code == 200
                url = fleet.urls["replica-0"]
                await fleet.remove_replica("replica-0")
                assert set(fleet.urls) == {joined}
                with pytest.raises(httpx.TransportError):
                    await client.get(url + "/health")
                with pytest.raises(ValueError, match="replica-0"):
                    await fleet.remove_replica("replica-0")
        finally:
            await fleet.stop()
    run(main())


def test_config_is_validated_by_key():
    with pytest.raises(ValueError, match="tick_s"):
        StateFleetConfig(tick_s=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        StateFleetConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="stream_phase must be one of spread, aligned"):
        StateFleetConfig(stream_phase="random")


def test_spread_replicas_stream_each_at_its_own_phase_and_aligned_ones_in_step():
    spread = [stream_phase_of(i, "spread") for i in range(256)]
    assert all(0.0 <= p < 1.0 for p in spread) and len(set(spread)) == 256
    # evenly over the interval: every tenth of it holds about a tenth of the replicas
    assert all(20 <= sum(k / 10 <= p < (k + 1) / 10 for p in spread) <= 31 for k in range(10))
    assert {stream_phase_of(i, "aligned") for i in range(256)} == {0.0}

    async def phases(how):
        fleet = StateFleet(StateFleetConfig(tick_s=0.002, stream_phase=how))
        await fleet.start(3)
        try:  # what each replica's app hands serve_state_stream
            return [fleet._served[f"replica-{i}"].server.app.stream_phase for i in range(3)]
        finally:
            await fleet.stop()
    assert run(phases("spread")) == [stream_phase_of(i, "spread") for i in range(3)]
    assert run(phases("aligned")) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("argv, phase", [((), "spread"),
                                          (("--state-stream-phase", "aligned"), "aligned")])
def test_kvguard_fleet_state_only_passes_the_stream_phase(monkeypatch, argv, phase):
    import argparse

    from chaos import fleet_cli
    parser = argparse.ArgumentParser()
    fleet_cli.configure(parser)
    configs = []

    async def started(args, config):  # the fleet's config, nothing started
        configs.append(config)
        return 0
    monkeypatch.setattr(fleet_cli, "_state_only", started)
    assert fleet_cli._run_state_only(parser.parse_args(["--state-only", *argv])) == 0
    assert [c.stream_phase for c in configs] == [phase]
    with pytest.raises(SystemExit):
        parser.parse_args(["--state-stream-phase", "random"])


def test_kvguard_fleet_state_only_runs_a_proxy_in_front_and_stops_on_sigterm():
    import os
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "guard.cli", "fleet", "--replicas", "3", "--state-only",
         "--proxies", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = []
    try:
        deadline_s = time.monotonic() + 90
        while time.monotonic() < deadline_s:
            line = proc.stdout.readline()
            lines.append(line)
            if not line or line.startswith("fleet ready"):
                break
        assert lines[-1].startswith("fleet ready"), "".join(lines)
        proxy_url, proxy_pid = next(
            (ln.split()[1], int(ln.split()[3])) for ln in lines if ln.startswith("proxy-0"))
        assert sum(ln.startswith("replica-") for ln in lines) == 3
        answer = httpx.post(proxy_url + "/v1/completions", timeout=30, trust_env=False,
                            json={"model": "llama-7b", "prompt": "hello " * 20,
                                  "max_tokens": 4})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "fleet stopped" in proc.stdout.read()
        with pytest.raises(ProcessLookupError):  # the proxy it started is gone too
            for _ in range(100):
                os.kill(proxy_pid, 0)
                time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_client_that_leaves_mid_stream_frees_its_sequence():
    async def main():
        fleet = StateFleet(StateFleetConfig(tick_s=0.002))
        await fleet.start(1)
        try:
            url = fleet.urls["replica-0"]
            async with httpx.AsyncClient(trust_env=False) as client:
                body = {"model": "llama-7b", "prompt": list(range(50)), "max_tokens": 2000,
                        "stream": True}
                async with client.stream("POST", url + "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            break  # one token, then the client goes
                for _ in range(200):
                    state = (await client.get(url + "/kvguard/state")).json()
                    if not state["running"]:
                        break
                    await asyncio.sleep(0.01)
                assert state["running"] == [] and state["num_free_blocks"] == \
                    state["num_total_blocks"]
        finally:
            await fleet.stop()
    run(main())


def test_a_fleet_with_few_kv_blocks_is_full_with_one_long_request():
    async def main():
        fleet = StateFleet(StateFleetConfig(tick_s=0.002, num_kv_blocks=20))
        await fleet.start(1)
        try:
            url = fleet.urls["replica-0"]
            async with httpx.AsyncClient(trust_env=False) as client:
                state = (await client.get(url + "/kvguard/state")).json()
                assert state["num_total_blocks"] == state["num_free_blocks"] == 20
                body = {"model": "llama-7b", "prompt": list(range(300)), "max_tokens": 4}
                answer = await client.post(url + "/v1/completions", json=body)
                assert answer.json()["usage"]["completion_tokens"] == 4
                state = (await client.get(url + "/kvguard/state")).json()
                assert state["iterations"][0]["num_prefill_tokens"] == 300  # 19 blocks fit
        finally:
            await fleet.stop()
    run(main())
    with pytest.raises(ValueError, match="num_kv_blocks"):
        StateFleetConfig(num_kv_blocks=0)


def test_held_sequences_keep_every_replica_running_r_of_its_own():
    """``held_running`` R: every replica runs R sequences without a client from its start, and
    one that ends is replaced, so R stay running."""
    async def main():
        fleet = StateFleet(StateFleetConfig(tick_s=0.002, held_running=3, max_model_len=40,
                                            time_scale=0.01))
        await fleet.start(2)
        try:
            async with httpx.AsyncClient(trust_env=False) as client:
                seen: set[str] = set()
                for _ in range(200):  # until a held sequence ended and its successor runs
                    await asyncio.sleep(0.01)
                    for url in fleet.urls.values():
                        state = (await client.get(url + "/kvguard/state")).json()
                        assert len(state["running"]) + len(state["waiting"]) == 3
                        assert all(s["num_prompt_tokens"] == 16 for s in state["running"])
                        seen.update(s["request_id"] for s in state["running"])
                    if len(seen) > 6:
                        break
                assert len(seen) > 6  # replaced: more than the 2 × 3 started
        finally:
            await fleet.stop()
    run(main())
    with pytest.raises(ValueError, match="held_running"):
        StateFleetConfig(held_running=-1)
    with pytest.raises(ValueError, match="max_num_seqs"):
        StateFleetConfig(held_running=9, max_num_seqs=8)


def test_kvguard_fleet_refuses_held_running_without_state_only():
    import argparse

    from chaos import fleet_cli

    parser = argparse.ArgumentParser()
    fleet_cli.configure(parser)
    with pytest.raises(ValueError, match="--state-held-running"):
        fleet_cli.run(parser.parse_args(["--state-held-running", "4"]))
