"""``kvguard bench scale --shed-flood``: a saturated state-only fleet behind a real proxy is
flooded in wall time and sheds every request at once; its flags are refused without it."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from chaos.bench import scale, scale_e2e, scale_flood
from chaos.load import run_queue_wait_s


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    scale.configure(parser)
    return parser.parse_args(list(argv))


def test_flood_flags_without_shed_flood_are_refused():
    with pytest.raises(ValueError, match="--flood-rate applies only with --shed-flood"):
        scale.run(parse("--replicas", "2", "--flood-rate", "100"))
    with pytest.raises(ValueError, match="--flood-stream-phase applies only with --shed-flood"):
        scale.run(parse("--replicas", "2", "--flood-stream-phase", "aligned"))
    with pytest.raises(ValueError, match="one at a time"):
        scale.run(parse("--shed-flood", "--e2e-rate", "10"))
    with pytest.raises(ValueError,
                       match="--flood-pin-proxy-cpu applies only with --shed-flood"):
        scale.run(parse("--replicas", "2", "--flood-pin-proxy-cpu", "0"))


def test_bad_flood_flags_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="--flood-rate"):
        scale_flood.run_flood(parse("--shed-flood", "--flood-rate", "0"))
    with pytest.raises(ValueError, match="--flood-kv-blocks"):
        scale_flood.run_flood(parse("--shed-flood", "--flood-kv-blocks", "0"))
    with pytest.raises(ValueError, match="--flood-refresh-s"):
        scale_flood.run_flood(parse("--shed-flood", "--flood-refresh-s", "0"))


def test_a_proxy_cpu_that_cannot_be_its_own_is_refused_before_anything_starts(tmp_path,
                                                                              monkeypatch):
    """Not a CPU this process may run on, or a machine of one CPU (the proxy would share it,
    which is the unpinned run): a clear error, no output folder, this process's CPUs as
    they were."""
    own = os.sched_getaffinity(0)
    out = tmp_path / "flood"
    with pytest.raises(ValueError, match=r"--flood-pin-proxy-cpu 4096: not a CPU this process "
                                         r"may run on"):
        scale.run(parse("--shed-flood", "--flood-pin-proxy-cpu", "4096",
                        "--flood-out", str(out)))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(ValueError, match="--flood-pin-proxy-cpu needs at least 2 CPUs"):
        scale.run(parse("--shed-flood", "--flood-pin-proxy-cpu", "0", "--flood-out", str(out)))
    monkeypatch.undo()
    assert not out.exists() and os.sched_getaffinity(0) == own


def test_the_proxy_child_runs_on_the_cpus_it_is_given():
    assert scale_e2e.proxy_child(["http://127.0.0.1:1"], "guard.toml", cpus=(1,)).cpus == (1,)
    assert scale_e2e.proxy_child(["http://127.0.0.1:1"], "guard.toml").cpus == ()


def test_a_process_run_queue_wait_is_read_from_its_schedstat():
    """The proxy's wait for a CPU: this process's own second schedstat field, which only
    grows; None for a process that is not there."""
    first = run_queue_wait_s(os.getpid())
    if first is None:
        pytest.skip("no /proc/<pid>/schedstat here")
    assert 0 <= first <= run_queue_wait_s(os.getpid())
    assert run_queue_wait_s(2**22 + 1) is None  # above Linux's largest pid


def test_the_held_request_is_one_http_request_of_the_given_length():
    raw = scale_flood.hold_request("llama-7b", 5, 100, "hold-3")
    head, body = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert f"content-length: {len(body)}".encode() in head and b"x-request-id: hold-3" in head
    assert json.loads(body) == {"model": "llama-7b", "prompt": [7] * 5, "max_tokens": 100,
                                "stream": False}


@pytest.mark.slow
def test_a_small_flood_is_shed_whole_and_every_request_answered(tmp_path, capsys):
    args = parse("--shed-flood", "--flood-replicas", "2", "--flood-rate", "100",
                 "--flood-duration", "1", "--flood-out", str(tmp_path), "--json")
    assert scale.run(args) == 0
    row = json.loads(capsys.readouterr().out)
    assert row == json.loads((tmp_path / "flood.json").read_text())
    assert row["replicas"] == 2 and row["kv_blocks_per_replica"] == 250  # 96 + 3,904 tokens
    assert row["refresh_s"] == 0.1 and row["stream_phase"] == "spread"
    assert row["offered"] > 50 and row["answered"] == row["offered"]
    assert row["admitted"] == 0 and row["shed"] == row["offered"]  # the fleet is full
    assert row["reasons"] == {"no_kv_capacity": row["offered"]}
    assert row["shed_p50_ms"] is not None and row["shed_p99_ms"] >= row["shed_p50_ms"]
    for key in ("proxy_cores", "fleet_cores", "loadgen_cpu_percent", "loadgen_warnings",
                "full_after_s", "proxy_idle_cores", "proxy_cpu_us_per_request"):
        assert key in row
    assert row["proxy_cpu_wait_s"] is None or row["proxy_cpu_wait_s"] >= 0
    own = sorted(os.sched_getaffinity(0))  # unpinned: all three share this process's CPUs
    assert row["proxy_cpus"] == row["fleet_cpus"] == row["loadgen_cpus"] == own


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs 2 CPUs")
def test_a_pinned_flood_runs_the_proxy_on_its_cpu_and_the_rest_elsewhere(tmp_path, capsys):
    """``--flood-pin-proxy-cpu N``: the proxy on N alone, the fleet and the generator (this
    process) on the others, the same flood shed whole, and this process's CPUs given back."""
    own = os.sched_getaffinity(0)
    proxy_cpu = max(own)
    args = parse("--shed-flood", "--flood-replicas", "2", "--flood-rate", "100",
                 "--flood-duration", "1", "--flood-pin-proxy-cpu", str(proxy_cpu),
                 "--flood-out", str(tmp_path), "--json")
    assert scale.run(args) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["proxy_cpus"] == [proxy_cpu]
    assert row["fleet_cpus"] == row["loadgen_cpus"] == sorted(own - {proxy_cpu})
    assert row["answered"] == row["offered"] > 50 and row["shed"] == row["offered"]
    assert os.sched_getaffinity(0) == own
