"""One quick run of a chaos scenario for the chaos quick tests: its verdict, every policy's
users and the run's folder (a skip when this build cannot run the scenario)."""

from __future__ import annotations

import json

import pytest

from chaos.chaos_cli import measure_capacity_rps, run_scenario
from chaos.scenario_run import RunSettings
from chaos.scenarios import catalogue, missing_dependencies, quick_variant
from chaos.user_record import UserRecord
from guard.cli import SUBCOMMANDS


def quick_scenario_run(name: str, policies: list[str], tmp_path_factory) -> tuple:
    """``(result, users by policy, out)`` of ``kvguard chaos run NAME --quick`` for ``policies``."""
    spec = quick_variant(catalogue()[name])
    missing = missing_dependencies(spec, SUBCOMMANDS)
    if missing:
        pytest.skip(f"{name} cannot run in this build: {'; '.join(missing)}")
    out = tmp_path_factory.mktemp(f"chaos-{name}")
    settings = RunSettings()
    capacity = measure_capacity_rps(settings, True, None, out, print)
    result = run_scenario(spec, policies, settings, out,
                          lambda m: print(m, flush=True), quick=True, capacity=capacity)
    users = {p: [UserRecord.from_dict(json.loads(line))
                 for line in open(out / p / "users.jsonl")] for p in result["policies"]}
    return result, users, out
