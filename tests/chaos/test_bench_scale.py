"""``kvguard bench scale``: its JSON carries decision µs and state CPU per replica count, and
the candidate-gap comparison finds no difference where the fleet is scanned."""

from __future__ import annotations

import argparse
import json

import pytest

from chaos.bench import scale
from chaos.bench.candidate_gap import candidate_gap


def test_scale_json_keys_by_replica_count(capsys):
    parser = argparse.ArgumentParser()
    scale.configure(parser)
    assert scale.run(parser.parse_args(["--replicas", "2,33", "--running", "4", "--calls", "5",
                                        "--policies", "slo,always-admit", "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["decide_p50_us"]) == {"2", "33"}
    assert set(out["decide_p50_us"]["33"]) == {"slo", "always-admit"}
    assert set(out["state_cpu_share"]) == {"2", "33"}
    rows = {row["replicas"]: row for row in out["rows"]}
    assert rows[33]["compact_bytes"] < rows[33]["document_bytes"]
    assert set(out["stream_state_cpu_share"]) == {"2", "33"}
    assert 0 < rows[33]["delta_bytes"] and rows[33]["stream_ingest_us"] > 0
    # the proxy's default source streams a kvguard replica: the headline share is the
    # stream's, and cores come from the mean CPU time of a refresh (refits included)
    assert out["state_cpu_share"] == out["stream_state_cpu_share"]
    assert set(out["compact_state_cpu_share"]) == {"2", "33"}
    for row in rows.values():
        for prefix, share in (("", "state_cpu_share"), ("compact_", "compact_state_cpu_share"),
                              ("stream_", "stream_state_cpu_share")):
            mean_us = row[f"{prefix}ingest_cpu_us"]
            assert row[share] == pytest.approx(mean_us * row["replicas"] * 10 / 1e6, abs=1e-4)


def test_a_learned_limit_is_on_every_replica_the_bench_refreshes(monkeypatch):
    """``--learned-limit``: the refreshes timed are those of replicas carrying a learned
    limit, as behind a proxy that has served requests."""
    seen = []
    real = scale.LoadState.update_from_kvguard_state

    def update(self, replica_id, state, now_s):  # noqa: ANN001, ANN202
        base = real(self, replica_id, state, now_s)
        seen.append(base.concurrency_limit)
        return base

    monkeypatch.setattr(scale.LoadState, "update_from_kvguard_state", update)
    row = scale.measure(33, 8, 3, 10.0, ("slo",), learned_limit=17)
    assert row["learned_limit"] == 17 and len(seen) > 4 * 33
    assert seen[33:] == [17] * len(seen[33:])  # every refresh after the fleet was built


def test_the_streamed_events_rebuild_the_documents_they_were_made_from():
    from guard.replicas.state_stream import StreamStateSource

    events = scale.stream_events(3, 40, 4)
    source = StreamStateSource("http://r")
    for raw in events:
        source.feed(json.loads(raw))
    doc = source.document()
    # 37 running, no prompt waiting; each event one ends, one arrives, and from the second
    # on the one that arrived before starts: 37 - 4 + 3
    assert len(doc["running_columns"]["request_id"]) == 36
    assert doc["running_columns"]["request_id"][0] == "r3-4"
    assert doc["running_columns"]["num_output_tokens"][0] == 4 + 4 * 5  # 5 steps an event
    assert doc["waiting_columns"]["request_id"] == ["n3-3"]


def test_the_plot_is_a_png(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    scale.configure(parser)
    path = tmp_path / "scale.png"
    assert scale.run(parser.parse_args(["--replicas", "2,4", "--running", "4", "--calls", "5",
                                        "--policies", "slo", "--plot", str(path)])) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_replica_counts_are_refused_by_flag():
    parser = argparse.ArgumentParser()
    scale.configure(parser)
    for flags, key in ((["--replicas", "0"], "--replicas"), (["--running", "x"], "--running")):
        try:
            scale.run(parser.parse_args(flags))
        except ValueError as exc:
            assert key in str(exc)
        else:
            raise AssertionError(f"{flags} accepted")


def test_a_scanned_fleet_has_no_candidate_gap():
    load_state, _, _ = scale._fleet(8, 16)  # under 32 replicas: no ranking, both scan
    gap = candidate_gap(load_state, 200)
    assert gap["other_kind_share"] == 0 and gap["ttft_gap_max_ms"] == 0
