"""The verdict of one chaos run (one policy), as pure functions of its users and its plan.

Figures, each with the threshold it is held to (``THRESHOLDS``):

- ``goodput_over_surviving_capacity``: good users per second among those who *arrived* during
  the fault window, divided by what the surviving replicas could serve within SLO — the smaller
  of the offered rate in that window (less users refused only for their tenant's budget) and
  ``capacity_per_replica × surviving replicas``.
- ``recovery_s``: from the end of the fault/burst until the good fraction of arrivals (good ÷
  offered, over a sliding window) stays ≥ 0.9 × its pre-fault level to the end of the run;
  None when it never does. Measured as a fraction so the post-fault base rate (equal to the
  pre-fault one) compares without Poisson noise in the rate itself.
- ``attempts_per_user`` (all users) and ``attempts_per_sdk_user`` (users on the OpenAI SDK).
- ``num_lost`` / ``num_hung``: users with neither an answer nor an explicit error within their
  patience / clients still inside an attempt past its own timeout at the drain deadline.
- ``num_cut_by_proxy_kill``: the lost users whose last attempt was a stream a proxy had begun
  (2xx) and that broke off, without ``[DONE]`` or an error event, when that proxy was SIGKILLed
  (ending within ``CUT_SLACK_S`` of a kill). The process that would have sent the error event
  is the one killed, and no client kind here re-sends a stream that broke (the OpenAI SDK does
  not), so no policy can save these; the ``lost`` check counts the others. They stay in
  ``num_lost`` and in every table. Each attempt records the entry it went to: one through a
  proxy that lived is never counted here.
- ``num_cut_by_replica_kill``: the users with an explicit error whose last attempt was a begun
  (2xx) stream that the proxy ended with an SSE error event within ``CUT_SLACK_S`` of a replica's
  SIGKILL. Bytes had reached the client, so no proxy may re-send it elsewhere, and no policy can
  save it; how many streams were on the killed replica at that instant is the routing's draw.
  They stay in ``error`` and in every table.
- ``num_cut_by_replica_kill_at_gateway``: the same streams when the replicas sit behind Envoy
  with ``kvguard epp`` as its endpoint picker: there they end *lost*, not in an error event.
  When a replica dies mid-body Envoy resets the client's stream at once (HTTP/1.1: the
  connection closes before the last chunk; HTTP/2: ``RST_STREAM``), and no Envoy mechanism
  writes bytes first — not ext_proc (the EPP gets no message after the reset), not a
  ``local_reply_config`` (only for replies Envoy sends itself, before the headers), not a Lua
  filter (its response coroutine is not resumed after a reset): tried against Envoy 1.40
  (docs/benchmarks.md §15). So no gateway policy can save them; they are the lost users
  whose last attempt was a begun (2xx) stream that broke off, with neither ``[DONE]`` nor an
  error event, within ``CUT_SLACK_S`` after a replica's SIGKILL it had been sent before. They
  stay in ``num_lost`` and in every table; the ``lost`` check counts the others.
- ``judged_good_share_uncut``: good users ÷ users of the tenants without a budget, leaving out
  those cut by a kill (either kind) — what the ``slo_vs_always_admit`` comparison compares, so
  that it measures admission, not how many streams each run happened to have on the victim.
- ``over_admission_ratio``: budgeted runs only: the most 2xx answers to the budgeted tenant
  were ever ahead of what its requests-per-minute bucket allowed by then, as a share of one
  window's limit.

``valid`` is false when the load generator lagged or starved (its warnings are listed): such a
run is not a result.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from chaos.records import RequestRecord
from chaos.user_record import USER_OUTCOMES, UserRecord
from policies.cost import RequestClass

__all__ = ["THRESHOLDS", "FaultWindow", "Budget", "good_fraction", "recovery_s", "build_verdict",
           "over_admission_ratio", "per_second", "series", "budget_denied",
           "BUDGET_REASONS", "cut_by_kill", "cut_by_replica_kill", "cut_by_replica_kill_at_gateway",
           "slo_vs_always_admit"]

THRESHOLDS: dict[str, dict] = {
    "goodput_over_surviving_capacity": {"min": 0.9, "policy": "slo"},
    "recovery_s": {"max_scaled_s": 2.0, "policy": "slo"},
    "attempts_per_sdk_user": {"max": 1.10, "policy": "slo"},
    "num_lost": {"max": 0, "policy": "slo"},
    "num_hung": {"max": 0, "policy": "any"},
    "over_admission_ratio": {"max_redis_up": 0.0, "max_redis_down": 0.10, "policy": "any"},
    # slo's share of good users (tenants without a budget, less streams cut by a kill) ÷
    # always_admit's on the same arrivals: in overload far above 1; below capacity both serve
    # nearly everyone, and "no harm" is the admission-quality bar (≥ 0.98 × the unguarded
    # run), not an exact tie in every user
    "slo_vs_always_admit": {"min_ratio": 0.98},
}
RECOVERY_LEVEL_RATIO = 0.9
CUT_SLACK_S = 1.0  # a stream cut by a proxy's death ends this soon after the SIGKILL (wall s)
BUDGET_REASONS: frozenset[str] = frozenset({"tpm_limit", "rpm_limit", "concurrency_limit"})


def budget_denied(user: UserRecord) -> bool:
    """Every attempt was refused for the tenant's budget (not servable by design)."""
    return bool(user.attempts) and all(a.status == 429 and a.reason in BUDGET_REASONS
                                       for a in user.attempts)


def cut_by_kill(user: UserRecord, cls: RequestClass, kills_s: Sequence[float],
                killed_entries: Collection[str] = ()) -> bool:
    """``user`` is lost, and their last attempt was a begun (2xx) stream that broke off, with
    neither ``[DONE]`` nor an error event, within ``CUT_SLACK_S`` after a kill in ``kills_s``
    (run seconds) it had been sent before — through one of ``killed_entries`` when the attempt
    recorded its entry and the kills are named (an attempt without one is judged on time)."""
    if not kills_s or not user.attempts or user.outcome(cls) != "lost":
        return False
    a = user.attempts[-1]
    if killed_entries and a.entry is not None and a.entry not in killed_entries:
        return False  # it went through a proxy that lived
    if a.saw_done or (a.error or "").startswith("stream error") or a.outcome == "canceled":
        return False
    return _begun_stream_ended_by_kill(a, kills_s)


def cut_by_replica_kill(user: UserRecord, cls: RequestClass, kills_s: Sequence[float]) -> bool:
    """``user`` ended with an explicit error, and their last attempt was a begun (2xx) stream
    that ended in an SSE error event within ``CUT_SLACK_S`` after a replica kill in ``kills_s``
    (run seconds) it had been sent before: the proxy telling the client its replica died."""
    if not kills_s or not user.attempts or user.outcome(cls) != "error":
        return False
    a = user.attempts[-1]
    if a.saw_done or not (a.error or "").startswith("stream error"):
        return False
    return _begun_stream_ended_by_kill(a, kills_s)


def cut_by_replica_kill_at_gateway(user: UserRecord, cls: RequestClass,
                                   kills_s: Sequence[float]) -> bool:
    """``user`` is lost, and their last attempt was a begun (2xx) stream that broke off, with
    neither ``[DONE]`` nor an error event, within ``CUT_SLACK_S`` after a replica kill in
    ``kills_s`` (run seconds) it had been sent before: Envoy resetting a client's stream whose
    replica died, with nothing the endpoint picker could write first."""
    return cut_by_kill(user, cls, kills_s)


def _begun_stream_ended_by_kill(a: RequestRecord, kills_s: Sequence[float]) -> bool:
    """``a`` was a begun (2xx) stream, sent before a kill in ``kills_s``, that ended within
    ``CUT_SLACK_S`` after it."""
    if a.sent_s is None or a.e2e_s is None or a.status is None or not 200 <= a.status < 300:
        return False
    end_s = a.sent_s + a.e2e_s
    return any(a.sent_s < k <= end_s + 0.05 and end_s <= k + CUT_SLACK_S for k in kills_s)


def slo_vs_always_admit(slo: Mapping, base: Mapping) -> tuple[float | None, float | None, bool]:
    """slo's and always_admit's ``judged_good_share_uncut`` and whether slo's is at least
    ``min_ratio`` × always_admit's."""
    s, b = slo["judged_good_share_uncut"], base["judged_good_share_uncut"]
    if b is None:       # nobody to judge in the baseline: nothing slo could fall short of
        return s, b, True
    return s, b, s is not None and s >= THRESHOLDS["slo_vs_always_admit"]["min_ratio"] * b


@dataclass(frozen=True)
class FaultWindow:
    """Run seconds (wall): warm-up end, fault/burst start and end, schedule end."""

    warmup_s: float
    start_s: float
    end_s: float
    run_end_s: float
    num_replicas: int
    num_surviving: int
    pre_end_s: float | None = None  # end of the pre-fault level (the first fault); default start

    def __post_init__(self) -> None:
        if not 0 <= self.warmup_s <= self.start_s < self.end_s <= self.run_end_s:
            raise ValueError(f"need 0 <= warmup <= start < end <= run end, got {self}")
        if self.pre_end_s is not None and not self.warmup_s < self.pre_end_s <= self.start_s:
            raise ValueError(f"need warmup < pre_end <= start, got {self}")
        if not 0 <= self.num_surviving <= self.num_replicas:
            raise ValueError("need 0 <= num_surviving <= num_replicas")

    @property
    def pre_fault_s(self) -> tuple[float, float]:
        return self.warmup_s, self.start_s if self.pre_end_s is None else self.pre_end_s


@dataclass(frozen=True)
class Budget:
    """One tenant's requests-per-minute limit (a bucket that starts full)."""

    tenant: str
    requests_per_minute: int
    redis_down: bool


def _outcomes(users: Sequence[UserRecord], cls: RequestClass) -> list[str]:
    return [u.outcome(cls) for u in users]


def good_fraction(users: Sequence[UserRecord], cls: RequestClass, lo_s: float,
                  hi_s: float) -> float | None:
    """Good ÷ offered among users arriving in ``[lo_s, hi_s)``; None if none arrived."""
    chosen = [u for u in users if lo_s <= u.scheduled_s < hi_s]
    if not chosen:
        return None
    return sum(u.outcome(cls) == "good" for u in chosen) / len(chosen)


def recovery_s(users: Sequence[UserRecord], cls: RequestClass, w: FaultWindow,
               slide_s: float) -> float | None:
    """Seconds from ``w.end_s`` until the good fraction stays ≥ 0.9 × its pre-fault level."""
    pre = good_fraction(users, cls, *w.pre_fault_s)
    if pre is None or pre == 0.0 or w.run_end_s - w.end_s < slide_s:
        return None
    step_s = slide_s / 4
    starts = [w.end_s + i * step_s
              for i in range(int((w.run_end_s - slide_s - w.end_s) / step_s) + 1)]
    ok = [(good_fraction(users, cls, s, s + slide_s) or 0.0) >= RECOVERY_LEVEL_RATIO * pre
          for s in starts]
    for i, start in enumerate(starts):
        if all(ok[i:]):
            return start - w.end_s
    return None


def over_admission_ratio(users: Sequence[UserRecord], budget: Budget) -> float:
    """The most 2xx answers to ``budget.tenant`` were ever ahead of its bucket (full at the
    first answer, refilling R a minute), as a share of one window's limit R. Checked at each
    answer's send time: retries answered after the schedule ends count against the allowance
    at their own time, and an excess paid back later still counts."""
    times = sorted(a.sent_s for u in users if u.tenant == budget.tenant for a in u.attempts
                   if a.sent_s is not None and a.status is not None and 200 <= a.status < 300)
    rpm = budget.requests_per_minute
    excess = max((n - rpm * (1.0 + (t - times[0]) / 60.0)
                  for n, t in enumerate(times, start=1)), default=0.0)
    return max(0.0, excess) / rpm


def _attempts_per_user(users: Sequence[UserRecord]) -> float | None:
    return sum(u.num_attempts for u in users) / len(users) if users else None


def build_verdict(users: Sequence[UserRecord], cls: RequestClass, w: FaultWindow,
                  capacity_per_replica_rps: float, *, slide_s: float,
                  generator_warnings: Sequence[str] = (), budget: Budget | None = None,
                  proxy_kills_s: Sequence[float] = (),
                  killed_entries: Collection[str] = (),
                  replica_kills_s: Sequence[float] = (), behind_gateway: bool = False) -> dict:
    """Every figure of the verdict for one policy's run; ``proxy_kills_s``: the run seconds at
    which a proxy the clients connect to was SIGKILLed; ``killed_entries``: those proxies'
    entry URLs; ``replica_kills_s``: the run seconds at which a replica was SIGKILLed;
    ``behind_gateway``: the replicas sit behind Envoy with ``kvguard epp`` (a stream a replica
    kill cuts is lost there, not an error: ``num_cut_by_replica_kill_at_gateway``)."""
    if capacity_per_replica_rps <= 0:
        raise ValueError("capacity_per_replica_rps must be > 0")
    measured = [u for u in users if u.scheduled_s >= w.warmup_s]
    outcomes = _outcomes(measured, cls)
    # What admission alone decides: users of every tenant without a budget. The budgeted
    # tenant's denials (and the SDK's retries after them) are the budget working, and which of
    # its requests land in the bucket's refill shifts with timing; counting them would make
    # recovery, retry amplification and the slo-vs-always_admit comparison measure the budget.
    judged = [u for u in users if budget is None or u.tenant != budget.tenant]
    judged_measured = [u for u in judged if u.scheduled_s >= w.warmup_s]
    judged_good = sum(u.outcome(cls) == "good" for u in judged_measured)
    # each measured user judged once per kind of cut (a proxy's cut is lost, a replica's an
    # error, or lost behind a gateway: a user is counted under one kind at most)
    proxy_cut = [u for u in measured if cut_by_kill(u, cls, proxy_kills_s, killed_entries)]
    replica_cut = [u for u in measured if cut_by_replica_kill(u, cls, replica_kills_s)]
    counted = {id(u) for u in proxy_cut}
    gateway_cut = [] if not behind_gateway else [
        u for u in measured if id(u) not in counted
        and cut_by_replica_kill_at_gateway(u, cls, replica_kills_s)]
    num_judged_uncut = len(judged_measured) - sum(
        budget is None or u.tenant != budget.tenant
        for u in (*proxy_cut, *replica_cut, *gateway_cut))
    in_fault = [u for u in measured if w.start_s <= u.scheduled_s < w.end_s]
    fault_s = w.end_s - w.start_s
    offered_rps = len(in_fault) / fault_s
    good_rps = sum(u.outcome(cls) == "good" for u in in_fault) / fault_s
    surviving_rps = capacity_per_replica_rps * w.num_surviving
    within_budget_rps = sum(not budget_denied(u) for u in in_fault) / fault_s
    servable_rps = min(within_budget_rps, surviving_rps)
    sdk = [u for u in judged_measured if u.client == "sdk"]
    return {
        "valid": not generator_warnings,
        "generator_warnings": list(generator_warnings),
        "num_users": len(measured),
        "outcomes": {o: outcomes.count(o) for o in USER_OUTCOMES},
        "num_judged_users": len(judged_measured),
        "judged_good": judged_good,
        "judged_good_share_uncut": judged_good / num_judged_uncut if num_judged_uncut else None,
        "fault_window_s": [w.start_s, w.end_s],
        "offered_in_fault_rps": offered_rps,
        "offered_within_budget_in_fault_rps": within_budget_rps,
        "good_in_fault_rps": good_rps,
        "surviving_capacity_rps": surviving_rps,
        "goodput_over_surviving_capacity": good_rps / servable_rps if servable_rps > 0 else None,
        "pre_fault_good_fraction": good_fraction(judged, cls, *w.pre_fault_s),
        "recovery_s": recovery_s(judged, cls, w, slide_s),
        "attempts_per_user": _attempts_per_user(measured),
        "attempts_per_sdk_user": _attempts_per_user(sdk),
        "num_lost": outcomes.count("lost"),
        "num_cut_by_proxy_kill": len(proxy_cut),
        "num_cut_by_replica_kill": len(replica_cut),
        "num_cut_by_replica_kill_at_gateway": len(gateway_cut),
        "num_hung": outcomes.count("hung"),
        "over_admission_ratio": None if budget is None else over_admission_ratio(users, budget),
    }


def per_second(times_s: Sequence[float], num_bins: int, bin_s: float) -> list[float]:
    """Events per second in bins of ``bin_s`` seconds."""
    bins = [0.0] * num_bins
    for t in times_s:
        i = math.floor(t / bin_s)
        if 0 <= i < num_bins:
            bins[i] += 1.0 / bin_s
    return bins


def series(users: Sequence[UserRecord], cls: RequestClass, end_s: float,
           bin_s: float) -> Mapping[str, list[float]]:
    """Per-bin rates for the timeline: offered users, upstream attempts, admitted (2xx)
    attempts, shed (429/503) attempts, good users (by arrival)."""
    n = max(1, math.ceil(end_s / bin_s))
    attempts = [a for u in users for a in u.attempts if a.sent_s is not None]
    return {
        "t_s": [i * bin_s for i in range(n)],
        "offered_users": per_second([u.scheduled_s for u in users], n, bin_s),
        "attempts": per_second([a.sent_s for a in attempts], n, bin_s),
        "admitted": per_second([a.sent_s for a in attempts
                                if a.status is not None and 200 <= a.status < 300], n, bin_s),
        "shed": per_second([a.sent_s for a in attempts if a.status in (429, 503)], n, bin_s),
        "good_users": per_second([u.scheduled_s for u in users if u.outcome(cls) == "good"],
                                 n, bin_s),
    }
