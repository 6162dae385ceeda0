"""Precomputed, seeded arrival schedules for open-loop load.

A schedule is built entirely before the run (so firing it costs nothing but a sleep) and is
a pure function of its ``ScheduleConfig``: the same seed gives the same arrivals, the same
request sizes, classes and tenants, and the same prompt token ids.

Shapes:
- ``poisson``: exponential gaps at ``rate_per_s``.
- ``constant``: one arrival every ``1 / rate_per_s`` seconds.
- ``burst``: Poisson at ``rate_per_s``, and at ``burst_rate_per_s`` inside
  ``[burst_start_s, burst_start_s + burst_duration_s)``. Because exponential gaps are
  memoryless, restarting the draw at each rate change gives an exact piecewise-constant
  Poisson process.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from chaos.records import RequestSpec
from chaos.workloads import Workload

__all__ = [
    "SHAPES",
    "LengthDist",
    "ClassShare",
    "ScheduleConfig",
    "build_schedule",
    "arrival_times",
    "prompt_token_ids",
    "tenant_key",
]

SHAPES: tuple[str, ...] = ("poisson", "constant", "burst")
TOKEN_ID_LOW = 1000
TOKEN_ID_HIGH = 20000


@dataclass(frozen=True)
class LengthDist:
    """A token-count distribution: ``fixed``, ``uniform`` (inclusive) or ``lognormal``.

    ``lognormal`` draws ``round(median * exp(sigma * N(0,1)))`` clamped to ``[low, high]``:
    a long right tail like real chat traffic (ShareGPT-style), with a hard cap.
    """

    kind: str
    low: int
    high: int
    median: float = 0.0
    sigma: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise ValueError(f"length kind must be fixed|uniform|lognormal, got {self.kind!r}")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"need 1 <= low <= high, got {self.low}..{self.high}")
        if self.kind == "lognormal" and (self.median <= 0 or self.sigma < 0):
            raise ValueError("lognormal needs median > 0 and sigma >= 0")

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """``"128"`` fixed, ``"64:512"`` uniform, ``"ln:MEDIAN:SIGMA:MAX"`` lognormal."""
        parts = text.strip().split(":")
        try:
            if len(parts) == 1:
                n = int(parts[0])
                return cls("fixed", n, n)
            if len(parts) == 2:
                return cls("uniform", int(parts[0]), int(parts[1]))
            if len(parts) == 4 and parts[0] == "ln":
                return cls("lognormal", 1, int(parts[3]), float(parts[1]), float(parts[2]))
        except ValueError as exc:
            raise ValueError(f"bad token length {text!r}: {exc}") from None
        raise ValueError(f"bad token length {text!r}: use N, LO:HI or ln:MEDIAN:SIGMA:MAX")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.low
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        n = round(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)))
        return min(self.high, max(self.low, n))


@dataclass(frozen=True)
class ClassShare:
    """A request class name and its share of the traffic (relative weight)."""

    name: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.name or self.weight <= 0:
            raise ValueError(f"class share needs a name and weight > 0, got {self!r}")


@dataclass(frozen=True)
class ScheduleConfig:
    rate_per_s: float
    duration_s: float
    shape: str = "poisson"
    seed: int = 0
    prompt_tokens: LengthDist = field(default_factory=lambda: LengthDist("fixed", 128, 128))
    output_tokens: LengthDist = field(default_factory=lambda: LengthDist("fixed", 64, 64))
    classes: tuple[ClassShare, ...] = (ClassShare("interactive"),)
    num_tenants: int = 1
    tenant_keys: tuple[str, ...] = ()  # explicit API keys; default chaos-tenant-0..N-1
    burst_rate_per_s: float = 0.0
    burst_start_s: float = 0.0
    burst_duration_s: float = 0.0
    # how prompts are shared (chaos.workloads.SharedPrefix / MultiTurn); None: all unique
    workload: Workload | None = None

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"shape must be one of {SHAPES}, got {self.shape!r}")
        if self.rate_per_s <= 0 or self.duration_s <= 0:
            raise ValueError("rate_per_s and duration_s must be > 0")
        if self.num_tenants < 1:
            raise ValueError(f"num_tenants must be >= 1, got {self.num_tenants}")
        if any(not k for k in self.tenant_keys):
            raise ValueError("tenant_keys must be non-empty strings")
        if not self.classes:
            raise ValueError("need at least one request class")
        if self.shape == "burst" and (self.burst_rate_per_s <= 0 or self.burst_duration_s <= 0
                                      or self.burst_start_s < 0):
            raise ValueError("burst shape needs burst_rate_per_s > 0, burst_duration_s > 0 "
                             "and burst_start_s >= 0")

    def rate_at(self, t_s: float) -> float:
        if self.shape == "burst" and self.in_burst(t_s):
            return self.burst_rate_per_s
        return self.rate_per_s

    def in_burst(self, t_s: float) -> bool:
        return self.burst_start_s <= t_s < self.burst_start_s + self.burst_duration_s

    def expected_count(self) -> float:
        """The declared number of arrivals over the whole duration."""
        if self.shape != "burst":
            return self.rate_per_s * self.duration_s
        start = min(self.burst_start_s, self.duration_s)
        end = min(self.burst_start_s + self.burst_duration_s, self.duration_s)
        burst_s = max(0.0, end - start)
        return self.rate_per_s * (self.duration_s - burst_s) + self.burst_rate_per_s * burst_s


def _rate_boundaries(cfg: ScheduleConfig) -> list[float]:
    if cfg.shape != "burst":
        return [cfg.duration_s]
    edges = [cfg.burst_start_s, cfg.burst_start_s + cfg.burst_duration_s, cfg.duration_s]
    return sorted({min(e, cfg.duration_s) for e in edges if e > 0})


def arrival_times(cfg: ScheduleConfig) -> list[float]:
    """Arrival offsets in seconds from the run start, ascending, all < ``duration_s``."""
    if cfg.shape == "constant":
        gap_s = 1.0 / cfg.rate_per_s
        return [i * gap_s for i in range(math.ceil(cfg.duration_s * cfg.rate_per_s - 1e-9))]
    rng = random.Random(f"arrivals-{cfg.seed}")
    times: list[float] = []
    t_s = 0.0
    for edge_s in _rate_boundaries(cfg):
        rate = cfg.rate_at(t_s)
        while True:
            t_next = t_s + rng.expovariate(rate)
            if t_next >= edge_s:
                t_s = edge_s  # memoryless: restart the draw at the rate change
                break
            times.append(t_next)
            t_s = t_next
    return times


def tenant_key(i: int) -> str:
    """The API key of tenant ``i`` (sent as ``Authorization: Bearer <key>``)."""
    return f"chaos-tenant-{i}"


def _pick_class(cfg: ScheduleConfig, rng: random.Random) -> str:
    names = [c.name for c in cfg.classes]
    return rng.choices(names, weights=[c.weight for c in cfg.classes])[0]


def _pick_tenant(cfg: ScheduleConfig, rng: random.Random) -> str:
    if cfg.tenant_keys:
        return cfg.tenant_keys[rng.randrange(len(cfg.tenant_keys))]
    return tenant_key(rng.randrange(cfg.num_tenants))


def build_schedule(cfg: ScheduleConfig) -> list[RequestSpec]:
    """The full arrival list: times from ``arrival_times``, sizes/classes/tenants seeded."""
    rng = random.Random(f"mix-{cfg.seed}")
    specs = []
    for i, t_s in enumerate(arrival_times(cfg)):
        specs.append(RequestSpec(
            index=i, scheduled_s=t_s,
            num_prompt_tokens=cfg.prompt_tokens.sample(rng),
            max_tokens=cfg.output_tokens.sample(rng),
            request_class=_pick_class(cfg, rng),
            tenant=_pick_tenant(cfg, rng),
        ))
    if cfg.workload is not None:
        specs = cfg.workload.apply(specs, cfg.seed)
    return specs


def prompt_token_ids(seed: int, spec: RequestSpec) -> list[int]:
    """Deterministic prompt token ids for one request, from a range every preset's vocab holds:
    unique to it, or its workload's parts in order (a shared prefix, a conversation so far)."""
    if spec.prompt_parts:
        ids: list[int] = []
        for key, num_tokens in spec.prompt_parts:
            rng = random.Random(f"part-{seed}-{key}")
            ids += rng.choices(range(TOKEN_ID_LOW, TOKEN_ID_HIGH), k=num_tokens)
        return ids
    rng = random.Random(f"prompt-{seed}-{spec.index}")
    return rng.choices(range(TOKEN_ID_LOW, TOKEN_ID_HIGH), k=spec.num_prompt_tokens)
