"""Which runs one ``kvguard bench overload`` makes: (load, policy) pairs, validated up front."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from chaos.overload_table import BARE

__all__ = ["ENVOY_ROWS", "FLEET_REFERENCE", "POLICIES", "REFERENCE_POLICIES", "ROUTING_POLICIES",
           "plan_runs", "plan_sdk_runs", "reference_policy"]

POLICIES: tuple[str, ...] = ("always_admit", "concurrency_cap", "saturation", "gradient",
                             "token_rate", "slo")
REFERENCE_POLICIES: tuple[str, ...] = (BARE, "slo")
# routing baselines for a fleet with prefix caches (named with --policies; not in the default)
ROUTING_POLICIES: tuple[str, ...] = ("round_robin", "prefix_affinity")
# A fleet needs something in front of its replicas, so it has no ``bare`` row: its reference
# is the proxy that routes (least-loaded) and admits everything.
FLEET_REFERENCE = "always_admit"
# Fleet rows with Envoy in front instead of kvguard proxy (``--fleet`` only): Envoy's own
# adaptive concurrency filter, or its circuit breakers and retry budget (no kvguard in
# either), and Envoy with kvguard epp deciding (slo)
ENVOY_ROWS: tuple[str, ...] = ("envoy_adaptive_concurrency", "envoy_circuit_breaker",
                               "envoy_epp_slo")


def reference_policy(args: argparse.Namespace) -> str:
    """The row every row's goodput is divided by (``÷ ref``): ``bare`` for one replica, the
    ``always_admit`` proxy for a fleet."""
    return FLEET_REFERENCE if getattr(args, "fleet", 0) else BARE


def _names(text: str, option: str, allowed: Sequence[str]) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if BARE in names and BARE not in allowed:
        raise ValueError(f"{option}: {BARE!r} has no fleet form (the replicas need the proxy in "
                         f"front); the fleet's reference row is {FLEET_REFERENCE}")
    unknown = set(names) - set(allowed)
    if unknown:
        raise ValueError(f"{option}: unknown {sorted(unknown)}; valid: {', '.join(allowed)}")
    return names


def _loads(text: str, option: str) -> list[float]:
    try:
        loads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{option}: not a list of numbers: {text!r}") from None
    if any(not x > 0 for x in loads):
        raise ValueError(f"{option}: loads must be > 0, got {text!r}")
    return loads


def plan_runs(args: argparse.Namespace) -> list[tuple[float, str]]:
    """``(load, policy)`` in run order: the reference loads (bare next to slo) first, then
    every policy at every load. Bad names or loads are ValueErrors before anything starts."""
    fleet = getattr(args, "fleet", 0)
    allowed = (*POLICIES, *ROUTING_POLICIES, *ENVOY_ROWS) if fleet else (BARE, *POLICIES,
                                                                         *ROUTING_POLICIES)
    loads = _loads(args.loads, "--loads")
    if not loads:
        raise ValueError("--loads: need at least one load")
    policies = _names(args.policies, "--policies", allowed)
    ref_loads = _loads(args.reference_loads, "--reference-loads")
    ref_text = args.reference_policies
    if ref_text is None:
        ref_text = ",".join((FLEET_REFERENCE, "slo") if fleet else REFERENCE_POLICIES)
    ref_policies = _names(ref_text, "--reference-policies", allowed)
    runs = [(load, p) for load in ref_loads for p in ref_policies]
    runs += [(load, p) for load in loads for p in policies]
    _check_envoy_max_requests(getattr(args, "envoy_max_requests", None),
                              any(p == "envoy_circuit_breaker" for _, p in runs))
    return list(dict.fromkeys(runs))


def _check_envoy_max_requests(max_requests, planned: bool) -> None:
    """The circuit-breaker row needs its M, and M needs the row. No default: the M that serves
    best depends on the request mix and the fleet, and the rules of thumb we tried missed it
    by half either way (docs/benchmarks.md §15); an operator finds it with a short sweep."""
    if max_requests is None:
        if planned:
            raise ValueError("envoy_circuit_breaker: needs --envoy-max-requests M (Envoy's "
                             "max_requests over the fleet; find it with a short sweep of M at "
                             "the bench's load)")
        return
    if isinstance(max_requests, bool) or not isinstance(max_requests, int) or max_requests < 1:
        raise ValueError(f"--envoy-max-requests: must be an integer >= 1, got {max_requests!r}")
    if not planned:
        raise ValueError("--envoy-max-requests: only the envoy_circuit_breaker row uses it "
                         "(--fleet, and name it in --policies)")


def plan_sdk_runs(args: argparse.Namespace) -> list[tuple[float, str]]:
    """The ``(load, policy)`` rows that also replay their arrivals as OpenAI-SDK users: every
    ``--sdk-loads`` × ``--sdk-policies`` pair that is a planned row (ValueError otherwise)."""
    sdk_loads = args.sdk_loads
    if getattr(args, "fleet", 0):
        if sdk_loads:
            raise ValueError("--sdk-loads: OpenAI-SDK users replay against one replica only; "
                             "leave it out with --fleet")
        return []
    pairs = [(load, p) for load in _loads("2.0" if sdk_loads is None else sdk_loads,
                                          "--sdk-loads")
             for p in _names(args.sdk_policies, "--sdk-policies", (BARE, *POLICIES))]
    planned = set(plan_runs(args))
    missing = [pair for pair in pairs if pair not in planned]
    if missing:
        raise ValueError(f"--sdk-loads/--sdk-policies name rows that do not run: {missing}")
    return pairs
