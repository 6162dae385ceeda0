"""``kvguard bench scale --proxy-state-cpu``: one row per replica count and running count, each
from a real proxy in front of a state-only fleet whose replicas run that many sequences of
their own; the in-process bench's own flags, and this mode's without it, are refused."""

from __future__ import annotations

import argparse
import json

import pytest

from chaos.bench import scale


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    scale.configure(parser)
    return parser.parse_args(argv)


@pytest.mark.slow
def test_rows_per_fleet_shape_from_a_real_proxy(capsys):
    assert scale.run(_parse(["--proxy-state-cpu", "--replicas", "2", "--running", "1,3",
                             "--proxy-state-window-s", "0.5", "--proxy-state-settle-s", "0.2",
                             "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["refresh_hz"] == 10.0 and out["time_scale"] == 1.0
    assert [(r["replicas"], r["running"]) for r in out["rows"]] == [(2, 1), (2, 3)]
    for row in out["rows"]:
        # every replica routable and streamed (the proxy's default source for a kvguard
        # replica); its events counted, and the CPU per event is the cores over them
        assert row["routable"] == row["streamed"] == 2
        assert row["events_per_s_offered"] == 20.0 and row["events_per_s"] > 0
        assert row["cpu_us_per_event"] == pytest.approx(
            row["proxy_cores"] / row["events_per_s"] * 1e6, rel=0.01, abs=0.1)
        assert row["state_age_max_s"] < 2.0


@pytest.mark.parametrize("argv, message", [
    (["--proxy-state-window-s", "2"], "--proxy-state-window-s applies only"),
    (["--proxy-state-time-scale", "4"], "--proxy-state-time-scale applies only"),
    (["--proxy-state-cpu", "--calls", "5"], "--calls does not apply"),
    (["--proxy-state-cpu", "--policies", "slo"], "--policies does not apply"),
    (["--proxy-state-cpu", "--shed-flood"], "one at a time"),
    (["--proxy-state-cpu", "--refresh-hz", "0"], "--refresh-hz"),
    (["--proxy-state-cpu", "--running", "300"], "at most 256"),
    (["--proxy-state-cpu", "--proxy-state-window-s", "0"], "--proxy-state-window-s"),
])
def test_flags_that_would_do_nothing_or_are_bad_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        scale.run(_parse(argv))
