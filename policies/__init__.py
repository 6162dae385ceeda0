"""kvguard policies: pure admission algorithms over a priced request and a load snapshot.

``make_policy(name, **params)`` builds one by name: the SLO-aware default (``slo``) or a
baseline that reproduces what the field does today (``always-admit``, ``concurrency-cap``,
``saturation``, ``gradient``, ``token-rate``, ``round-robin``, ``prefix-affinity``).
"""

from __future__ import annotations

from policies.always_admit import AlwaysAdmit
from policies.concurrency_cap import ConcurrencyCap
from policies.cost import RequestClass, RequestCost
from policies.decision import Admit, CompletionSample, Decision, Queue, Shed
from policies.gradient import Gradient
from policies.policy import Policy
from policies.predictor import TtftForecast, forecast, predict_ttft_s
from policies.prefix_affinity import PrefixAffinity
from policies.round_robin import RoundRobin
from policies.saturation import Saturation
from policies.slo import SloPolicy, shed_order
from policies.snapshot import LoadSnapshot, ReplicaSnapshot, SeqLoad
from policies.step_time import StepTimeModel
from policies.token_rate import TokenRate

__all__ = [
    "Admit",
    "AlwaysAdmit",
    "CompletionSample",
    "ConcurrencyCap",
    "Decision",
    "Gradient",
    "LoadSnapshot",
    "Policy",
    "PrefixAffinity",
    "Queue",
    "ReplicaSnapshot",
    "RoundRobin",
    "RequestClass",
    "RequestCost",
    "Saturation",
    "SeqLoad",
    "Shed",
    "SloPolicy",
    "StepTimeModel",
    "TokenRate",
    "TtftForecast",
    "forecast",
    "make_policy",
    "policy_names",
    "predict_ttft_s",
    "shed_order",
]


def _policy_classes() -> dict[str, type]:
    return {
        SloPolicy.name: SloPolicy,
        AlwaysAdmit.name: AlwaysAdmit,
        ConcurrencyCap.name: ConcurrencyCap,
        Saturation.name: Saturation,
        Gradient.name: Gradient,
        TokenRate.name: TokenRate,
        RoundRobin.name: RoundRobin,
        PrefixAffinity.name: PrefixAffinity,
    }


def policy_names() -> tuple[str, ...]:
    """Names ``make_policy`` accepts, the default first."""
    return tuple(_policy_classes())


def make_policy(name: str, **params: object) -> Policy:
    """Build the policy called ``name`` (``_`` and ``-`` are interchangeable).

    Raises ``ValueError`` for an unknown name (listing the valid ones), an unknown parameter,
    or a bad parameter value.
    """
    classes = _policy_classes()
    cls = classes.get(name.replace("_", "-"))
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(classes)}")
    try:
        return cls(**params)
    except TypeError as exc:
        raise ValueError(f"bad parameters for policy {name!r}: {exc}") from exc
