"""Envoy's circuit breakers and retry budget as a bake-off row: the thresholds an operator would
derive and the config Envoy 1.40 accepts (``envoy --mode validate``)."""

import json
import subprocess

import pytest

from chaos.envoy_breaker import CircuitBreaker
from chaos.envoy_front import envoy_alone_config, envoy_binary


def test_thresholds_from_the_capacity_and_the_ttft_limit():
    breaker = CircuitBreaker.at_capacity(40, capacity_rps=24.0, ttft_limit_s=2.0)
    # P = C x half the TTFT limit: the queue the fleet drains within half the budget
    assert (breaker.max_requests, breaker.max_pending_requests) == (40, 24)
    assert CircuitBreaker.at_capacity(5, 0.5, 0.2).max_pending_requests == 1
    for bad in ({"max_requests": 0, "max_pending_requests": 1},
                {"max_requests": 1.5, "max_pending_requests": 1},
                {"max_requests": 1, "max_pending_requests": 1, "retry_budget_percent": 0}):
        with pytest.raises(ValueError):
            CircuitBreaker(**bad)
    with pytest.raises(ValueError):
        CircuitBreaker.at_capacity(4, 0.0, 2.0)


def test_the_config_envoy_runs_has_the_breakers_retry_budget_and_retries(tmp_path):
    breaker = CircuitBreaker.at_capacity(40, 24.0, 2.0)
    path = envoy_alone_config(tmp_path, listener_port=18001, admin_port=18002,
                              upstreams=["127.0.0.1:18003", "127.0.0.1:18004"],
                              circuit_breaker=breaker)
    config = json.loads(path.read_text())
    (cluster,) = config["static_resources"]["clusters"]
    (thresholds,) = cluster["circuit_breakers"]["thresholds"]
    assert thresholds["max_requests"] == thresholds["max_connections"] == 40
    assert thresholds["max_pending_requests"] == 24
    assert thresholds["retry_budget"] == {"budget_percent": {"value": 20.0},
                                          "min_retry_concurrency": 3}
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    route = manager["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["retry_policy"]["retry_on"] == "5xx,reset,connect-failure"
    # no kvguard anywhere in the request path
    assert [f["name"] for f in manager["http_filters"]] == ["envoy.filters.http.router"]
    checked = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)],
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # and validation is strict: a misspelt field is refused (so the pass above means something)
    thresholds["retry_budgett"] = thresholds.pop("retry_budget")
    path.write_text(json.dumps(config))
    refused = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "retry_budgett" in refused.stdout + refused.stderr
