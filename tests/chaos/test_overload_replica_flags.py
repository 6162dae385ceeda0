"""The overload bench's replica flags reach the replicas it starts (real sim replicas over
loopback): ``--num-blocks`` sizes the KV pool of the bare replica and of the guarded one,
``--replica-http`` picks their HTTP server, and bad values are refused before anything starts."""

from __future__ import annotations

import argparse

import httpx
import pytest

from chaos import overload
from chaos.overload import Scenario, configure
from chaos.scenario_run import RunSettings


def scenario(*argv: str) -> Scenario:
    p = argparse.ArgumentParser()
    configure(p)
    return Scenario(p.parse_args(list(argv)))


class _Seen(Exception):
    """Raised by the fake load run once it has read the replica's state."""


def test_num_blocks_is_passed_to_the_engine_only_when_given():
    args = scenario("--num-blocks", "512").engine_args()
    assert args[args.index("--num-blocks") + 1] == "512"
    assert "--num-blocks" not in scenario().engine_args()


@pytest.mark.parametrize("value", ["0", "-3"])
def test_num_blocks_below_one_is_refused(value):
    with pytest.raises(ValueError, match="--num-blocks must be >= 1"):
        scenario("--num-blocks", value)


def test_num_blocks_that_is_not_an_integer_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        scenario("--num-blocks", "lots")
    assert "--num-blocks" in capsys.readouterr().err


def test_chaos_settings_carry_the_kv_pool_and_seq_limit_to_replicas_and_capacity_probe():
    settings = RunSettings(num_blocks=256, max_num_seqs=32)
    args = settings.engine_args()
    assert args[args.index("--num-blocks") + 1] == "256"
    assert args[args.index("--max-num-seqs") + 1] == "32"
    probe = Scenario(settings.overload_args(16.0))
    assert (probe.args.num_blocks, probe.args.max_num_seqs) == (256, 32)
    assert "--num-blocks" not in RunSettings().engine_args()
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        RunSettings(num_blocks=0)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        RunSettings(max_num_seqs=0)


def test_replica_http_picks_the_replicas_server_and_defaults_to_h11():
    args = scenario("--replica-http", "kvguard").engine_args()
    assert args[args.index("--http") + 1] == "kvguard"
    args = scenario().engine_args()
    assert args[args.index("--http") + 1] == "h11"


def test_replica_http_reaches_the_chaos_replicas_and_the_fleet_demo():
    from chaos import demo
    from chaos.fleet_demo import _settings

    args = RunSettings(replica_http="kvguard").engine_args()
    assert args[args.index("--http") + 1] == "kvguard"
    assert Scenario(RunSettings(replica_http="kvguard").overload_args(16.0)).engine_args()[-1] \
        == "kvguard"  # the capacity probe's replica too
    with pytest.raises(ValueError, match="replica_http"):
        RunSettings(replica_http="nginx")
    p = argparse.ArgumentParser()
    demo.configure(p)
    settings = _settings(p.parse_args(["--scenario", "seed", "--replica-http", "kvguard"]))
    assert settings.replica_http == "kvguard"


@pytest.mark.slow
@pytest.mark.parametrize("policy, http", [("bare", "h11"), ("slo", "kvguard")])
def test_the_replica_a_bench_row_runs_on_has_the_blocks_asked_for(policy, http, tmp_path,
                                                                   monkeypatch):
    s = scenario("--gpu", "a100-80g", "--time-scale", "4", "--num-blocks", "512",
                 "--replica-http", http)
    seen = {}

    def fake_run_once(args, rate, out, progress):
        response = httpx.get(args.url.rstrip("/") + "/kvguard/state", timeout=10.0,
                             trust_env=False)
        seen["state"], seen["server"] = response.json(), response.headers.get("server")
        raise _Seen

    monkeypatch.setattr(overload, "run_once", fake_run_once)
    with pytest.raises(_Seen):
        overload.run_policy(s, policy, 1.0, 1.0, tmp_path / policy)
    state = seen["state"]  # with the guard mounted in-process: the engine's state, relayed
    assert state["num_total_blocks"] == 512 and state["num_free_blocks"] == 512
    assert state["timing_model"]["gpu"]["name"] == "a100-80g" and state["time_scale"] == 4.0
    assert seen["server"] == ("uvicorn" if http == "h11" else None)  # kvguard's names none
