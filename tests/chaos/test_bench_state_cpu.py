"""``kvguard bench state-cpu``: a real proxy per state source in front of real state-only
replicas; its JSON has one row per source and repeat, every replica routable."""

from __future__ import annotations

import argparse
import json

import pytest

from chaos.bench import state_cpu

pytestmark = pytest.mark.slow


def test_state_cpu_rows_per_source(capsys):
    parser = argparse.ArgumentParser()
    state_cpu.configure(parser)
    args = parser.parse_args(["--replicas", "3", "--window-s", "0.5", "--settle-s", "0.5",
                              "--repeats", "1", "--json"])
    assert state_cpu.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["source"] for r in out["rows"]] == ["kvguard", "stream"]
    for row in out["rows"]:
        assert row["routable"] == row["replicas"] == 3
        assert row["proxy_cores"] >= 0 and row["state_age_max_s"] < 2.0


def test_bad_flags_are_refused():
    parser = argparse.ArgumentParser()
    state_cpu.configure(parser)
    with pytest.raises(ValueError, match="--replicas"):
        state_cpu.run(parser.parse_args(["--replicas", "0"]))
