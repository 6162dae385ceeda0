"""Which runs one ``kvguard bench overload`` makes: (load, policy) pairs, validated up front."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from chaos.overload_table import BARE

__all__ = ["POLICIES", "REFERENCE_POLICIES", "plan_runs", "plan_sdk_runs"]

POLICIES: tuple[str, ...] = ("always_admit", "concurrency_cap", "saturation", "gradient",
                             "token_rate", "slo")
REFERENCE_POLICIES: tuple[str, ...] = (BARE, "slo")


def _names(text: str, option: str, allowed: Sequence[str]) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
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
    allowed = (BARE, *POLICIES)
    loads = _loads(args.loads, "--loads")
    if not loads:
        raise ValueError("--loads: need at least one load")
    policies = _names(args.policies, "--policies", allowed)
    ref_loads = _loads(args.reference_loads, "--reference-loads")
    ref_policies = _names(args.reference_policies, "--reference-policies", allowed)
    runs = [(load, p) for load in ref_loads for p in ref_policies]
    runs += [(load, p) for load in loads for p in policies]
    return list(dict.fromkeys(runs))


def plan_sdk_runs(args: argparse.Namespace) -> list[tuple[float, str]]:
    """The ``(load, policy)`` rows that also replay their arrivals as OpenAI-SDK users: every
    ``--sdk-loads`` × ``--sdk-policies`` pair that is a planned row (ValueError otherwise)."""
    pairs = [(load, p) for load in _loads(args.sdk_loads, "--sdk-loads")
             for p in _names(args.sdk_policies, "--sdk-policies", (BARE, *POLICIES))]
    planned = set(plan_runs(args))
    missing = [pair for pair in pairs if pair not in planned]
    if missing:
        raise ValueError(f"--sdk-loads/--sdk-policies name rows that do not run: {missing}")
    return pairs
