"""``kvguard bench overload --fleet`` with Envoy in front: its three Envoy rows run end to end
at a tiny scale (real Envoy, real EPP, 2 sim replicas) and land in the table."""

import json

import pytest

from guard.cli import main as kvguard

pytestmark = pytest.mark.slow


def test_the_envoy_rows_of_the_fleet_bake_off_run(tmp_path, capsys):
    out = tmp_path / "fleet"
    rc = kvguard(["bench", "overload", "--fleet", "2", "--capacity", "3", "--time-scale", "2",
                  "--duration", "2", "--warmup", "0.5", "--client-timeout", "3",
                  "--prompt-tokens", "256:512", "--output-tokens", "8:16", "--loads", "1.5",
                  "--policies", "envoy_adaptive_concurrency,envoy_circuit_breaker,envoy_epp_slo",
                  "--envoy-max-requests", "3",
                  "--reference-loads", "", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| 1.50 | envoy_adaptive_concurrency |" in printed
    assert "| 1.50 | envoy_epp_slo |" in printed
    assert "| 1.50 | envoy_circuit_breaker |" in printed
    result = json.loads((out / "overload.json").read_text())
    rows = {r["policy"]: r for r in result["rows"]}
    assert set(rows) == {"envoy_adaptive_concurrency", "envoy_circuit_breaker", "envoy_epp_slo"}
    breaker = rows["envoy_circuit_breaker"]["envoy_circuit_breaker"]
    assert breaker["max_requests"] == 3 and breaker["max_pending_requests"] >= 1
    envoy_config = json.loads(next((out / "envoy_circuit_breaker-1.50").glob(
        "envoy-alone-*.json")).read_text())
    (thresholds,) = envoy_config["static_resources"]["clusters"][0]["circuit_breakers"][
        "thresholds"]
    assert thresholds["max_requests"] == breaker["max_requests"]
    for policy in rows:
        summary = json.loads((out / f"{policy}-1.50" / "summary.json").read_text())
        assert summary["reconciles"] and summary["counts"]["offered"] > 0
        assert summary["counts"]["completed"] > 0  # requests got through Envoy to a replica
    # the EPP row was decided by kvguard (its trace); Envoy's own row has no guard at all
    assert (out / "envoy_epp_slo-1.50" / "guard-trace.jsonl").stat().st_size > 0
    for envoy_alone in ("envoy_adaptive_concurrency", "envoy_circuit_breaker"):
        assert not (out / f"{envoy_alone}-1.50" / "guard-trace.jsonl").exists()
