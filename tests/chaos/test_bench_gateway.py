"""``kvguard bench gateway --pin-epp-cpu N``: the ext_proc servers on CPU N, everything else the
bench starts on the other CPUs (the bench's figures are in docs/benchmarks.md §15)."""

import argparse
import json
import os

import pytest

from chaos.bench import gateway
from chaos.bench.gateway import CpuPinning, cpu_pinning


def test_pin_epp_cpu_splits_the_cpus_and_refuses_a_machine_it_cannot_split():
    assert cpu_pinning(None) is None
    assert cpu_pinning(1, available={0, 1}) == CpuPinning(epp_cpus=(1,), other_cpus=(0,))
    assert cpu_pinning(0, available={0, 1, 2, 3}) == CpuPinning((0,), (1, 2, 3))
    with pytest.raises(ValueError, match="at least 2 CPUs"):
        cpu_pinning(0, available={0})
    with pytest.raises(ValueError, match="not a CPU this process may run on"):
        cpu_pinning(5, available={0, 1})


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gateway.configure(parser)
    return parser.parse_args(list(argv))


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs 2 CPUs")
def test_the_bench_runs_its_ext_proc_servers_on_their_cpu_and_the_rest_elsewhere(tmp_path):
    """Every row's process (the ext_proc server's for the Envoy + ext_proc rows, Envoy's for
    Envoy alone, the replica's, the proxy's) ran where ``--pin-epp-cpu`` put it, and the bench
    gives this process its CPUs back afterwards."""
    own = os.sched_getaffinity(0)
    epp_cpu = max(own)
    rest = sorted(own - {epp_cpu})
    out = tmp_path / "gateway.json"
    args = _args("--requests", "2", "--warmup", "1", "--rate-s", "0", "--idle-s", "0.1",
                 "--pin-epp-cpu", str(epp_cpu), "--out", str(out))
    assert gateway.run(args) == 0
    assert os.sched_getaffinity(0) == own
    results = json.loads(out.read_text())
    assert results["pinning"] == {"epp_cpus": [epp_cpu], "other_cpus": rest}
    rows = results["latency"]
    for name in (gateway.FLOOR, "envoy + kvguard epp", gateway.SPLIT):
        assert rows[name]["cpus"] == [epp_cpu], name
    for name in ("direct", "envoy alone", "kvguard proxy slo"):
        assert rows[name]["cpus"] == rest, name


@pytest.mark.slow
def test_each_ext_proc_variant_serves_every_stream_through_its_own_envoy(tmp_path):
    """``python -m chaos.bench.ext_proc_variants``: the floor on grpc's thread-pool server, and
    on grpc.aio behind Envoy's Google gRPC client over a Unix socket, each route every
    measured stream to the replica and back whole (a bad stream fails the run)."""
    from chaos.bench import ext_proc_variants

    out = tmp_path / "variants.json"
    assert ext_proc_variants.main(["--variants", "sync,aio-google-unix", "--requests", "3",
                                   "--warmup", "1", "--idle-s", "0.1", "--envoy-stages",
                                   "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert list(rows) == ["direct", "envoy alone", "sync", "aio-google-unix"]
    assert all(row["n"] == 3 for row in rows.values())
    # Envoy's own timestamps, for each Envoy: behind ext_proc the request goes upstream only
    # after the whole of it arrived and the server answered it
    assert "envoy_stages_ms" not in rows["direct"]
    assert rows["envoy alone"]["envoy_stages_ms"]["DS_RX_BEG:US_TX_BEG"] > 0
    for name in ("sync", "aio-google-unix"):
        stages = rows[name]["envoy_stages_ms"]
        assert stages["DS_RX_END:US_TX_BEG"] > 0
        assert stages["DS_RX_BEG:US_TX_BEG"] > stages["DS_RX_BEG:DS_RX_END"]
    with pytest.raises(SystemExit):
        ext_proc_variants.main(["--variants", "no-such-variant"])
