"""The bake-off's OpenAI-SDK column: the same arrivals, each user on the official Python SDK.

For one (load, policy) row, a fresh replica with that policy gets the row's seeded arrivals
again, each arrival one user whose client is the OpenAI Python SDK with its default retries
(``max_retries=2``; it honours ``x-should-retry`` and ``retry-after-ms``: ``chaos.sdk_client``).
Reported next to the row: upstream attempts per user (the retry storm's size) and user goodput
÷ C — users whose answer came within their patience with the first token within the class TTFT
*from their arrival* and every gap within the ITL, per second of the goodput window.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from chaos.overload_table import BARE
from chaos.replica import ReplicaProcess, write_guard_config
from chaos.schedule import ClassShare, ScheduleConfig, build_schedule

__all__ = ["sdk_row", "summarize_users", "require_user_runner"]


def require_user_runner() -> None:
    """Raise a clear ValueError now (before hours of runs) if the chaos suite's user runner
    and its OpenAI SDK client are not installed in this tree."""
    try:
        from chaos.clients import ClientConfig  # noqa: F401
        from chaos.users import UserRunConfig, run_users  # noqa: F401
    except ImportError as exc:
        raise ValueError("the SDK column (--sdk-loads) needs the chaos suite's user runner "
                           f"(chaos.users): {exc}; pass --sdk-loads '' to run without it") from None


def summarize_users(users, cls, window_s: tuple[float, float], cap_rps: float) -> dict:
    """Attempts per user and user goodput ÷ C over the users who arrived in ``window_s``."""
    inside = [u for u in users if window_s[0] <= u.scheduled_s < window_s[1]]
    num_good = sum(u.outcome(cls) == "good" for u in inside)
    span_s = window_s[1] - window_s[0]
    return {"num_users": len(inside),
            "attempts_per_user": (sum(u.num_attempts for u in inside) / len(inside)
                                  if inside else None),
            "goodput_rps": num_good / span_s if span_s > 0 else 0.0,
            "goodput_over_c": num_good / span_s / cap_rps if span_s > 0 else 0.0}


def sdk_row(scenario, policy: str | None, rate: float, cap_rps: float, out: Path,
            policy_params: dict) -> dict:
    """One fresh replica (``policy``; None: no guard), the row's arrivals as SDK users."""
    require_user_runner()
    from chaos.clients import ClientConfig
    from chaos.users import UserRunConfig, run_users

    out.mkdir(parents=True, exist_ok=True)
    engine_args = scenario.engine_args()
    c = scenario.request_class
    if policy is not None and policy != BARE:
        engine_args += ["--guard", write_guard_config(str(out / "guard.toml"), policy=policy,
                                                      ttft_s=c.ttft_s, itl_s=c.itl_s,
                                                      trace_path=str(out / "guard-trace.jsonl"),
                                                      policy_params=policy_params)]
    sched = ScheduleConfig(rate_per_s=rate, duration_s=scenario.duration_s,
                           shape=scenario.args.shape, seed=scenario.args.seed,
                           prompt_tokens=scenario.prompt, output_tokens=scenario.output,
                           classes=(ClassShare(c.name),))
    specs = build_schedule(sched)
    cfgs = {"sdk": ClientConfig("sdk", patience_s=scenario.timeout_s)}
    with ReplicaProcess.start(engine_args) as replica:
        run_cfg = UserRunConfig(entry_urls=(replica.base_url,), duration_s=sched.duration_s,
                                drain_timeout_s=scenario.timeout_s + 1.0,
                                seed=scenario.args.seed, model=scenario.args.model)
        result = asyncio.run(run_users(specs, ["sdk"] * len(specs), cfgs, run_cfg))
    with open(out / "users.jsonl", "w", encoding="utf-8") as f:
        f.writelines(u.to_json() + "\n" for u in result.users)
    row = summarize_users(result.users, c, (scenario.warmup_s, scenario.duration_s), cap_rps)
    row["warnings"] = result.warnings()
    return row
