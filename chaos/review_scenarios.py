"""The scenario matrix of ``kvguard review``: what traffic each scenario sends and when its
judged window is. Times and rates are in GPU seconds and multiples of the fleet's capacity
``C`` (the baseline's), scaled to wall time by the run's time scale.

- ``steady``: 0.74 C.
- ``burst``: 0.74 C with a burst to 1.16 C; judged over the burst. Its prompts are long
  (2,048–4,000 tokens, within llama-7b's 4,096-token context): most take more prefill than
  one step within the 80 ms ITL holds beside the running streams (about 2,700 tokens on the
  H100), so a batched-token budget past what the ITL allows shows as stalled streams.
- ``replica-loss``: the burst, and one replica SIGKILLed early in it (not restarted).
- ``warm-up``: 0.74 C on a cold fleet, judged from the first arrival.
- ``cache``: 0.74 C of shared-prefix traffic (8 system prompts of 1,024 tokens, each request
  adding its own 128–1,024 tokens), where the engines' prefix cache pays.
- ``ramp``: arrivals rising linearly from 0.3 C to 1.2 C.

C is the baseline fleet's saturation throughput on each scenario's own traffic
(``chaos.review_capacity``), so 1.16 C is past what the baseline serves: the burst is long
enough (8 GPU s quick, 16 s full) for its backlog to pass the 1 s TTFT objective.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from chaos.client import request_body
from chaos.records import RequestSpec
from chaos.review_capacity import replica_capacity_gpu_rps
from chaos.schedule import (
    TOKEN_ID_HIGH,
    TOKEN_ID_LOW,
    LengthDist,
    ScheduleConfig,
    build_schedule,
    prompt_token_ids,
)

__all__ = ["ReviewScenario", "scenario_matrix", "traffic", "capacity_gpu_rps", "PROMPT_TOKENS",
           "LONG_PROMPT_TOKENS", "OUTPUT_TOKENS"]

PROMPT_TOKENS = "512:2048"
LONG_PROMPT_TOKENS = "2048:4000"
CACHE_PROMPT_TOKENS = "1152:2048"
OUTPUT_TOKENS = "16:64"
NUM_PREFIXES = 8
PREFIX_TOKENS = 1024


@dataclass(frozen=True)
class ReviewScenario:
    name: str
    description: str
    duration_s: float
    window_s: tuple[float, float]
    load: float = 0.74                # × C
    burst: tuple[float, float, float] | None = None  # (start_s, end_s, load × C)
    kill_at_s: float | None = None    # replica 1 SIGKILLed then, for good
    ramp_to_load: float | None = None  # arrivals rise linearly from ``load`` to this
    shared_prefix: bool = False
    prompt_tokens: str = PROMPT_TOKENS

    def scaled(self, k: float) -> ReviewScenario:
        """Wall-clock version at time scale ``k`` (rates are scaled by the caller)."""
        burst = None if self.burst is None else (self.burst[0] * k, self.burst[1] * k,
                                                 self.burst[2])
        return ReviewScenario(self.name, self.description, self.duration_s * k,
                              (self.window_s[0] * k, self.window_s[1] * k), self.load, burst,
                              None if self.kill_at_s is None else self.kill_at_s * k,
                              self.ramp_to_load, self.shared_prefix, self.prompt_tokens)


def scenario_matrix(quick: bool) -> list[ReviewScenario]:
    """Every scenario; ``quick`` shortens each to a few GPU seconds of judged window."""
    d = 0.5 if quick else 1.0

    def t(x: float) -> float:
        return round(x * d, 3)

    return [
        ReviewScenario("steady", "0.74 C", t(12), (t(2), t(12))),
        ReviewScenario("burst", "0.74 C, a burst to 1.16 C, long prompts", t(22), (t(4), t(20)),
                       burst=(t(4), t(20), 1.16), prompt_tokens=LONG_PROMPT_TOKENS),
        ReviewScenario("replica-loss", "the burst, one replica lost in it", t(22), (t(5), t(20)),
                       burst=(t(4), t(20), 1.16), kill_at_s=t(5),
                       prompt_tokens=LONG_PROMPT_TOKENS),
        ReviewScenario("warm-up", "0.74 C on a cold fleet", t(8), (0.0, t(4))),
        ReviewScenario("cache", "0.74 C of shared-prefix traffic", t(12), (t(2), t(12)),
                       shared_prefix=True, prompt_tokens=CACHE_PROMPT_TOKENS),
        ReviewScenario("ramp", "0.3 C rising to 1.2 C", t(16), (t(2), t(16)), load=0.3,
                       ramp_to_load=1.2),
    ]


def _ramp(specs: list[RequestSpec], peak_rate: float, scenario: ReviewScenario,
          capacity_rps: float, seed: int) -> list[RequestSpec]:
    """Thin a Poisson stream at the peak rate to a linear ramp (seeded)."""
    rng = random.Random(f"ramp-{seed}")
    lo, hi = scenario.load * capacity_rps, scenario.ramp_to_load * capacity_rps
    kept = [s for s in specs
            if rng.random() < (lo + (hi - lo) * s.scheduled_s / scenario.duration_s) / peak_rate]
    return [RequestSpec(i, s.scheduled_s, s.num_prompt_tokens, s.max_tokens, s.request_class,
                        s.tenant) for i, s in enumerate(kept)]


def _prefix(seed: int, number: int) -> list[int]:
    rng = random.Random(f"prefix-{seed}-{number}")
    return rng.choices(range(TOKEN_ID_LOW, TOKEN_ID_HIGH), k=PREFIX_TOKENS)


def traffic(scenario: ReviewScenario, capacity_rps: float, seed: int,
            model: str) -> tuple[list[RequestSpec], list[bytes]]:
    """The seeded arrivals and bodies of a (wall-clock) scenario; ``capacity_rps`` is C in
    wall requests per second."""
    prompt = LengthDist.parse(scenario.prompt_tokens)
    peak = scenario.load if scenario.ramp_to_load is None else scenario.ramp_to_load
    burst = {} if scenario.burst is None else dict(
        shape="burst", burst_rate_per_s=scenario.burst[2] * capacity_rps,
        burst_start_s=scenario.burst[0], burst_duration_s=scenario.burst[1] - scenario.burst[0])
    cfg = ScheduleConfig(rate_per_s=peak * capacity_rps, duration_s=scenario.duration_s,
                         seed=seed, prompt_tokens=prompt,
                         output_tokens=LengthDist.parse(OUTPUT_TOKENS), **burst)
    specs = build_schedule(cfg)
    if scenario.ramp_to_load is not None:
        specs = _ramp(specs, peak * capacity_rps, scenario, capacity_rps, seed)
    if not scenario.shared_prefix:
        bodies = [request_body(model, json.dumps(prompt_token_ids(seed, s)), s.max_tokens)
                  for s in specs]
        return specs, bodies
    prefixes = [_prefix(seed, i) for i in range(NUM_PREFIXES)]
    bodies = []
    for s in specs:
        tail = prompt_token_ids(seed, s)[PREFIX_TOKENS:]
        ids = prefixes[random.Random(f"pick-{seed}-{s.index}").randrange(NUM_PREFIXES)] + tail
        bodies.append(request_body(model, json.dumps(ids), s.max_tokens))
    return specs, bodies


def capacity_gpu_rps(scenario: ReviewScenario, fleet) -> float:
    """C of ``scenario``'s traffic on ``fleet`` (a ``FleetSpec``: the baseline), GPU req/s.
    The cache scenario's C prices every prompt token as computed, cache or not: the same
    arrivals for a fleet with the cache and one without, the cache's gain shown as shorter
    TTFT and idle accelerator time."""
    return fleet.replicas * replica_capacity_gpu_rps(
        fleet.engine, LengthDist.parse(scenario.prompt_tokens), LengthDist.parse(OUTPUT_TOKENS))
