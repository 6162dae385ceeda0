"""The scenario catalogue, its quick variants, and `kvguard chaos list` / refusals."""

import dataclasses

import pytest

from chaos.faults import Fault
from chaos.scenario_run import RunSettings, budget_for, client_configs, schedule_for
from chaos.scenarios import ScenarioSpec, catalogue, missing_dependencies, quick_variant
from guard.cli import main as kvguard

NAMES = ["burst", "retry-storm", "redis-kill", "redis-hang", "proxy-kill", "metastable",
         "replica-kill", "seed", "recovery", "seed-envoy", "epp-kill", "epp-kill-split",
         "cache-loss", "warm-up", "proxy-kill-envoy"]


def test_every_scenario_the_issue_names_is_there():
    assert sorted(catalogue()) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_quick_variant_keeps_the_shape_and_fits_its_window(name):
    full = catalogue()[name]
    quick = quick_variant(full)
    assert quick.duration_s <= 13.0 < full.duration_s
    assert [f.kind for f in quick.faults] == [f.kind for f in full.faults]
    lo, hi = quick.fault_window_s
    assert quick.warmup_s < lo < hi <= quick.duration_s - 4.0       # room to recover
    assert min(f.at_s for f in quick.faults) == 4.0
    assert all(f.duration_s is None or f.duration_s <= 3.0 for f in quick.faults)


def test_recovery_is_a_10_s_burst_at_3_c_with_sdk_clients():
    spec = catalogue()["recovery"]
    step = spec.rate_step
    assert (spec.burst_load, step.duration_s, dict(spec.clients)) == (3.0, 10.0, {"sdk": 1.0})
    assert spec.fault_window_s == (step.at_s, step.end_s)
    assert spec.duration_s - step.end_s >= 10.0                     # time to watch it recover


def test_seed_is_the_reference_overload():
    seed = catalogue()["seed"]
    assert (seed.base_load, seed.burst_load, seed.replicas, seed.num_surviving) == \
        (0.74, 1.16, 4, 3)
    kill = next(f for f in seed.faults if f.kind == "replica_kill")
    step = seed.rate_step
    assert step.at_s <= kill.at_s < step.end_s                      # lost during the burst
    assert set(seed.clients) >= {"sdk", "timeout_retry"}


def test_schedule_is_scaled_and_seeded():
    spec, settings = catalogue()["burst"], RunSettings(time_scale=2.0, seed=3)
    sched = schedule_for(spec, settings, fleet_rps=10.0)
    assert sched.rate_per_s == pytest.approx(7.4) and sched.burst_rate_per_s == 16.0
    assert (sched.burst_start_s, sched.burst_duration_s, sched.duration_s) == (16.0, 12.0, 48.0)
    assert sched == schedule_for(spec, settings, fleet_rps=10.0)
    assert budget_for(spec, sched) is None
    redis = catalogue()["redis-kill"]
    b = budget_for(redis, schedule_for(redis, settings, 10.0))
    assert b.redis_down and b.tenant == "chaos-budgeted"
    sched = schedule_for(redis, settings, 10.0)              # 1 user in 4, 1.25 × the allowance
    assert b.requests_per_minute == round(0.25 * sched.expected_count() / (1.25 * (1 + 48 / 60)))


def test_client_knobs_scale_with_time():
    cfgs = client_configs(RunSettings(time_scale=3.0))
    assert cfgs["sdk"].patience_s == 18.0 and cfgs["sdk"].retries == 2
    assert cfgs["timeout_retry"].attempt_timeout_s == pytest.approx(4.5)
    assert cfgs["tenacity"].backoff_s == 1.5


def test_bad_scenarios_are_refused():
    spec = catalogue()["burst"]
    with pytest.raises(ValueError, match="window"):
        dataclasses.replace(spec, fault_window_s=(30.0, 40.0))
    with pytest.raises(ValueError, match="in-process"):
        dataclasses.replace(spec, replicas=2)
    with pytest.raises(ValueError, match="rate_step"):
        dataclasses.replace(spec, faults=(Fault("rate_step", 8.0, 1.0),
                                          Fault("rate_step", 9.0, 1.0)))
    with pytest.raises(ValueError, match="entry_balancer"):  # Envoy balances proxies only
        dataclasses.replace(spec, entry_balancer="envoy")
    with pytest.raises(ValueError, match="entry_balancer"):
        dataclasses.replace(catalogue()["proxy-kill"], entry_balancer="nginx")


def test_proxy_kill_envoy_is_proxy_kill_with_envoy_in_front_of_the_proxies(tmp_path):
    from chaos.scenario_run import _topology

    plain, envoy = catalogue()["proxy-kill"], catalogue()["proxy-kill-envoy"]
    assert dataclasses.replace(envoy, name=plain.name, summary=plain.summary,
                               entry_balancer="clients") == plain
    assert "envoy" in envoy.needs() and "envoy" not in plain.needs()
    spec = _topology(envoy, RunSettings(), str(tmp_path / "guard.toml"))
    assert spec.entry_envoy and spec.num_proxies == 2 and spec.num_epps == 0
    assert not _topology(plain, RunSettings(), str(tmp_path / "guard.toml")).entry_envoy


def test_epp_kill_split_is_epp_kill_on_envoys_split_config(tmp_path):
    from chaos.scenario_run import _topology

    plain, split = catalogue()["epp-kill"], catalogue()["epp-kill-split"]
    assert dataclasses.replace(split, name=plain.name, summary=plain.summary,
                               epp_split=False) == plain
    spec = _topology(quick_variant(split), RunSettings(), str(tmp_path / "guard.toml"))
    assert spec.split and spec.num_epps == 2 and spec.redis
    assert not _topology(plain, RunSettings(), str(tmp_path / "guard.toml")).split
    with pytest.raises(ValueError, match="epp_split"):       # the split config fronts EPPs
        dataclasses.replace(catalogue()["replica-kill"], epp_split=True)


def test_missing_dependencies_name_what_is_missing(monkeypatch):
    spec = catalogue()["replica-kill"]
    assert missing_dependencies(spec, {"proxy": 1}) == []
    (why,) = missing_dependencies(spec, {})
    assert "kvguard proxy" in why
    assert missing_dependencies(catalogue()["burst"], {}) == []
    import chaos.envoy_front
    monkeypatch.setattr(chaos.envoy_front, "envoy_binary",
                        lambda: (_ for _ in ()).throw(ValueError("envoy: not installed")))
    assert missing_dependencies(catalogue()["proxy-kill-envoy"], {"proxy": 1}) == [
        "envoy: not installed"]
    assert isinstance(catalogue()["seed"], ScenarioSpec)


def test_list_shows_every_scenario_and_its_state(capsys):
    assert kvguard(["chaos", "list"]) == 0
    out = capsys.readouterr().out
    for name in NAMES:
        assert name in out
    assert "ready" in out


def test_run_refuses_unknown_and_unavailable_scenarios(capsys, monkeypatch):
    assert kvguard(["chaos", "run", "earthquake", "--quick"]) == 2
    assert "no scenario 'earthquake'" in capsys.readouterr().err
    import guard.cli
    monkeypatch.setattr(guard.cli, "SUBCOMMANDS",
                        {k: v for k, v in guard.cli.SUBCOMMANDS.items() if k != "proxy"})
    assert kvguard(["chaos", "run", "replica-kill", "--quick"]) == 2
    assert "cannot run in this build" in capsys.readouterr().err


def test_fleet_demo_refuses_without_the_proxy(capsys, monkeypatch):
    import guard.cli
    monkeypatch.setattr(guard.cli, "SUBCOMMANDS",
                        {k: v for k, v in guard.cli.SUBCOMMANDS.items() if k != "proxy"})
    assert kvguard(["demo", "--scenario", "seed"]) == 2
    assert "demo --scenario seed cannot run" in capsys.readouterr().err


def test_fault_window_follows_the_faults_as_they_happened():
    from chaos.faults import FaultEvent
    from chaos.scenario_run import fault_window
    spec, settings = catalogue()["seed"], RunSettings(time_scale=2.0)
    planned = fault_window(spec, settings, [])
    assert (planned.start_s, planned.end_s, planned.pre_fault_s) == (24.0, 40.0, (8.0, 20.0))
    late = [FaultEvent(21.0, "rate_step", "rate", "rate up"),
            FaultEvent(30.0, "replica_kill", "replica-1", "kill"),
            FaultEvent(40.5, "rate_step", "rate", "rate down"),
            FaultEvent(49.0, "replica_kill", "replica-1", "restart"),
            FaultEvent(55.0, "replica_kill", "replica-1", "healthy")]
    w = fault_window(spec, settings, late)
    assert (w.start_s, w.end_s, w.num_surviving) == (30.0, 55.0, 3)


def test_fleet_demo_runs_seed_for_always_admit_and_slo_with_the_demo_flags(monkeypatch, tmp_path):
    """The wiring only (the scenario run itself is covered by the quick-scenario tests)."""
    import chaos.fleet_demo as fleet_demo
    from tests.chaos.test_chaos_report import _verdict
    seen = {}

    def fake_run(spec, policies, settings, out, log, *, quick, capacity):
        seen.update(spec=spec.name, policies=policies, settings=settings, quick=quick,
                    capacity=capacity, out=out)
        return {"policies": {p: _verdict(6.0) for p in policies}}

    monkeypatch.setattr(fleet_demo, "run_scenario", fake_run)
    assert kvguard(["demo", "--scenario", "seed", "--replica-capacity", "5.5", "--time-scale", "3",
                    "--ttft", "0.5", "--seed", "7", "--num-blocks", "300", "--max-num-seqs", "32",
                    "--out", str(tmp_path / "d")]) == 0
    assert seen["spec"] == "seed" and seen["policies"] == ["always_admit", "slo"]
    assert seen["capacity"] == (5.5, "given (--replica-capacity)") and not seen["quick"]
    s = seen["settings"]
    assert (s.time_scale, s.ttft_s, s.seed, s.num_blocks, s.max_num_seqs) == (3.0, 0.5, 7, 300, 32)
    assert seen["out"] == tmp_path / "d"


def test_capacity_measurement_arguments_cover_every_flag_the_bench_reads(tmp_path):
    """The chaos runner measures capacity with ``chaos.overload``; every flag that bench reads
    must be present (a flag added to the bench and missing here crashed ``chaos run seed``)."""
    from chaos.overload import Scenario
    from chaos.scenario_run import RunSettings

    scenario = Scenario(RunSettings().overload_args(16.0))
    args = scenario.load_args("http://127.0.0.1:1", 3.0, tmp_path)
    assert args.shape == "poisson" and args.rate == 3.0


@pytest.mark.parametrize("name", ["recovery", "seed"])  # one replica in-process; a fleet
def test_every_scenario_fleet_runs_below_the_load_generator(name, tmp_path):
    """The users' clock is read first on a small machine: every child of a scenario's topology
    (and of the fleet bake-off) starts at FLEET_NICENESS."""
    from chaos.overload_fleet import Fleet
    from chaos.scenario_run import _topology
    from chaos.topology import FLEET_NICENESS

    spec = _topology(catalogue()[name], RunSettings(), str(tmp_path / "guard.toml"))
    assert spec.niceness == FLEET_NICENESS > 0

    class Scenario:
        def engine_args(self):
            return ["--model", "llama-7b", "--backend", "sim"]

    assert Fleet(Scenario(), 2).topology.spec.niceness == FLEET_NICENESS


def test_the_cache_scenarios_run_a_shared_prefix_load_on_pools_holding_half_of_it():
    from chaos.scenarios import settings_for

    for name in ("cache-loss", "warm-up"):
        spec = catalogue()[name]
        settings = settings_for(spec, RunSettings())
        assert (spec.replicas, settings.num_blocks, settings.prompt_tokens) == (4, 2000, "50:150")
        # 32 prefixes of 2,000 tokens across 4 pools of 2,000 blocks of 16: half of them each
        assert spec.workload.num_prefixes * spec.workload.prefix_tokens == 2 * 2000 * 16
        sched = schedule_for(spec, settings, 10.0)
        assert sched.workload == spec.workload
        assert "--num-blocks" in settings.engine_args()
        assert settings.overload_args(8.0).workload == "shared-prefix"
    cache_loss = catalogue()["cache-loss"]
    assert [f.kind for f in cache_loss.faults] == ["replica_kill_hot"]
    assert cache_loss.num_surviving == 3
    warm = catalogue()["warm-up"]
    assert sorted(f.target for f in warm.faults) == [0, 1, 2, 3]  # the whole fleet, at once
    assert len({f.at_s for f in warm.faults}) == 1
