"""What one measurement window cost, and what its good and its wasted requests cost: pure
functions of engine steps, request fates and prices.

A window's expense splits into components (``guard.observe.cost_config.COMPONENTS``):

- ``accelerator``: every provisioned replica for the whole window, busy or not. Its **busy**
  part is the engine steps that ran inside the window (each step clipped to it); the rest is
  **idle**. Each step's cost goes to the requests in it by their share of the step's work:
  ``per_prefill_token_s × prefill + per_decode_token_s × decode + per_kv_read_token_s × KV
  read`` (the roofline's linear coefficients, so a share is the part of the step's predicted
  time the request caused). So the requests' costs plus idle are the accelerator total exactly.
- ``host``: every replica and every guard/proxy process for the whole window.
- ``network``: the bytes in and out at the guard during the window.
- ``idle_reserve``: the warm spare replicas (accelerator + host) for the whole window.
- ``energy``: joules the replicas used in the window, when ``energy_usd_per_kwh`` > 0.

Good and wasted requests are counted like goodput (``chaos.goodput``): a request belongs to the
window its **arrival** falls in. Cost per good request is the window's total ÷ its good
requests: None (reported "n/a") when no request was good, never zero or infinity. **Wasted** is
the busy cost, spent inside the window, on requests that finished late, failed or were
canceled, plus the recomputation after preemption of any request; by class and tenant.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from chaos.goodput import Window
from guard.observe.cost_config import COMPONENTS, CostConfig

__all__ = ["FATES", "WASTED_FATES", "WorkWeights", "StepWork", "Step", "RequestFate",
           "Fleet", "WindowCost", "window_cost", "format_usd"]

# what became of a request: good (met its SLO), late (completed, missed it), failed, canceled,
# rejected (shed before any engine work), unknown (engine work with no client record)
FATES = ("good", "late", "failed", "canceled", "rejected", "unknown")
WASTED_FATES = frozenset({"late", "failed", "canceled"})


@dataclass(frozen=True)
class WorkWeights:
    """Seconds of step time per unit of work (the roofline prior's linear coefficients)."""

    per_prefill_token_s: float = 1.0
    per_decode_token_s: float = 1.0
    per_kv_read_token_s: float = 0.0

    def __post_init__(self) -> None:
        values = (self.per_prefill_token_s, self.per_decode_token_s, self.per_kv_read_token_s)
        if any(not v >= 0 for v in values) or not any(v > 0 for v in values):
            raise ValueError(f"work weights must be >= 0 with one > 0, got {values}")

    @classmethod
    def from_step_time_prior(cls, prior: Mapping[str, float]) -> WorkWeights:
        """From ``TimingModel.as_step_time_prior()`` (a decode token costs its sequence's
        per-step coefficient)."""
        return cls(prior["per_prefill_token_s"], prior["per_decode_seq_s"],
                   prior["per_context_token_s"])


@dataclass(frozen=True)
class StepWork:
    """One request's tokens in one step (``engine.outputs.RequestWork``, by value)."""

    request_id: str
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_kv_read_tokens: int = 0
    num_recomputed_tokens: int = 0

    def weight(self, w: WorkWeights) -> float:
        return (w.per_prefill_token_s * self.num_prefill_tokens
                + w.per_decode_token_s * self.num_decode_tokens
                + w.per_kv_read_token_s * self.num_kv_read_tokens)

    def recomputed_share(self) -> float:
        """The part of this request's prefill that was recomputation (0 … 1)."""
        if not self.num_prefill_tokens:
            return 0.0
        return min(self.num_recomputed_tokens / self.num_prefill_tokens, 1.0)


@dataclass(frozen=True)
class Step:
    """One engine step of one replica, on the run's clock (seconds)."""

    replica_id: str
    start_s: float
    end_s: float
    work: tuple[StepWork, ...]

    def __post_init__(self) -> None:
        if not self.end_s >= self.start_s:
            raise ValueError(f"step on {self.replica_id}: end_s {self.end_s} < start_s {self.start_s}")

    def overlap_s(self, window: Window) -> float:
        return max(0.0, min(self.end_s, window.end_s) - max(self.start_s, window.start_s))


@dataclass(frozen=True)
class RequestFate:
    """What became of one request, as the client (or guard) judged it."""

    request_id: str
    arrival_s: float
    fate: str
    request_class: str = "-"
    tenant: str = "-"
    num_output_tokens: int = 0

    def __post_init__(self) -> None:
        if self.fate not in FATES:
            raise ValueError(f"fate must be one of {FATES}, got {self.fate!r}")


@dataclass(frozen=True)
class Fleet:
    """What was provisioned and what crossed the network during one window."""

    num_replicas: int
    num_guards: int = 1
    network_bytes: int = 0
    energy_j: float = 0.0

    def __post_init__(self) -> None:
        if self.num_replicas < 0 or self.num_guards < 0 or self.network_bytes < 0 \
                or not self.energy_j >= 0:
            raise ValueError(f"fleet numbers must be >= 0, got {self}")


@dataclass(frozen=True)
class WindowCost:
    window: Window
    components_usd: Mapping[str, float]
    accelerator_busy_usd: float
    accelerator_idle_usd: float
    request_usd: Mapping[str, float]  # request id -> busy accelerator cost inside the window
    num_good: int
    num_good_output_tokens: int
    wasted_usd: float
    wasted_by_class_usd: Mapping[str, float]
    wasted_by_tenant_usd: Mapping[str, float]
    fates: Mapping[str, int] = field(default_factory=dict)

    @property
    def total_usd(self) -> float:
        return sum(self.components_usd.values())

    @property
    def cost_per_good_request_usd(self) -> float | None:
        """None when no request in the window was good: undefined, not zero."""
        return self.total_usd / self.num_good if self.num_good else None

    @property
    def cost_per_million_good_output_tokens_usd(self) -> float | None:
        if not self.num_good_output_tokens:
            return None
        return self.total_usd / self.num_good_output_tokens * 1e6

    @property
    def wasted_share(self) -> float | None:
        """Wasted ÷ total (None for a window that cost nothing)."""
        return self.wasted_usd / self.total_usd if self.total_usd else None

    def to_dict(self) -> dict:
        return {
            "window_s": [self.window.start_s, self.window.end_s],
            "total_usd": self.total_usd,
            "components_usd": dict(self.components_usd),
            "accelerator_busy_usd": self.accelerator_busy_usd,
            "accelerator_idle_usd": self.accelerator_idle_usd,
            "num_good": self.num_good,
            "num_good_output_tokens": self.num_good_output_tokens,
            "cost_per_good_request_usd": self.cost_per_good_request_usd,
            "cost_per_million_good_output_tokens_usd":
                self.cost_per_million_good_output_tokens_usd,
            "wasted_usd": self.wasted_usd,
            "wasted_share": self.wasted_share,
            "wasted_by_class_usd": dict(self.wasted_by_class_usd),
            "wasted_by_tenant_usd": dict(self.wasted_by_tenant_usd),
            "fates": dict(self.fates),
        }


def _attribute(steps: Iterable[Step], window: Window, usd_per_s: float,
               weights: WorkWeights) -> tuple[dict[str, float], dict[str, float], float]:
    """(busy cost per request, recomputation cost per request, busy total)."""
    per_request: dict[str, float] = defaultdict(float)
    recomputed: dict[str, float] = defaultdict(float)
    busy = 0.0
    for step in steps:
        step_usd = step.overlap_s(window) * usd_per_s
        if step_usd == 0.0 or not step.work:
            continue
        busy += step_usd
        shares = [w.weight(weights) for w in step.work]
        total = sum(shares)
        if total == 0.0:
            shares, total = [1.0] * len(step.work), float(len(step.work))
        for work, share in zip(step.work, shares, strict=True):
            usd = step_usd * share / total
            per_request[work.request_id] += usd
            recomputed[work.request_id] += usd * work.recomputed_share()
    return dict(per_request), dict(recomputed), busy


def window_cost(window: Window, steps: Iterable[Step], fates: Iterable[RequestFate],
                config: CostConfig, fleet: Fleet,
                weights: WorkWeights = WorkWeights()) -> WindowCost:
    """The window's expense by component, per request, and per good / wasted request."""
    duration_s = window.duration_s
    accelerator = fleet.num_replicas * duration_s * config.accelerator_usd_per_s
    per_request, recomputed, busy = _attribute(steps, window, config.accelerator_usd_per_s,
                                               weights)
    if busy > accelerator * (1 + 1e-9):
        raise ValueError(f"steps keep more than {fleet.num_replicas} replica(s) busy in {window}")
    components = dict.fromkeys(COMPONENTS, 0.0)
    components["accelerator"] = accelerator
    components["host"] = (fleet.num_replicas + fleet.num_guards) * duration_s * config.host_usd_per_s
    components["network"] = fleet.network_bytes * config.network_usd_per_byte
    components["idle_reserve"] = duration_s * config.reserve_usd_per_s
    components["energy"] = fleet.energy_j * config.energy_usd_per_joule
    by_id = {f.request_id: f for f in fates}
    wasted_class: dict[str, float] = defaultdict(float)
    wasted_tenant: dict[str, float] = defaultdict(float)
    for request_id, usd in per_request.items():
        fate = by_id.get(request_id)
        kind = fate.fate if fate is not None else "unknown"
        waste = usd if kind in WASTED_FATES else recomputed.get(request_id, 0.0)
        if waste:
            wasted_class[fate.request_class if fate else "-"] += waste
            wasted_tenant[fate.tenant if fate else "-"] += waste
    arrived = [f for f in by_id.values() if window.contains(f.arrival_s)]
    good = [f for f in arrived if f.fate == "good"]
    counts = {k: sum(f.fate == k for f in arrived) for k in FATES}
    return WindowCost(
        window=window, components_usd=components, accelerator_busy_usd=busy,
        accelerator_idle_usd=accelerator - sum(per_request.values()), request_usd=per_request,
        num_good=len(good), num_good_output_tokens=sum(f.num_output_tokens for f in good),
        wasted_usd=sum(wasted_class.values()), wasted_by_class_usd=dict(wasted_class),
        wasted_by_tenant_usd=dict(wasted_tenant), fates=counts)


def format_usd(value: float | None) -> str:
    """Dollars for a report cell; ``n/a`` for an undefined number (no good request)."""
    if value is None:
        return "n/a"
    return f"${value:.6f}" if abs(value) < 0.01 else f"${value:,.4f}"
