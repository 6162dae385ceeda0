"""``kvguard bench guard --against DIR``: this checkout's guard and another checkout's, side by
side in one run.

Two versions of the ``guard`` package cannot share one interpreter, so each round runs the
in-process measurement (bare app vs guarded app, alternating blocks, as
:func:`chaos.bench.guard.measure_in_process` does) once per checkout, each in a fresh interpreter whose
``PYTHONPATH`` is that checkout, alternating which goes first so drift hits both equally. The
driving code is this checkout's (``_ROUND``), run on each checkout's own ``trivial_app`` and
``_guarded`` middleware, so both sides are timed the same way. The result is the median of each
side's per-round added median and their ratio (current ÷ baseline: below 1 is faster), for wall
time and for thread CPU time per request (``cpu``: steadier when other processes share the
cores, since it counts only this thread's work).

    git worktree add /tmp/old-guard <commit>
    kvguard bench guard --against /tmp/old-guard
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

__all__ = ["measure_against", "render_against"]

# One round in the checkout on PYTHONPATH: its trivial app and guarded middleware, driven here.
_ROUND = """
import asyncio, json, statistics, sys, time
try:
    from chaos.bench.guard import _BODY, _SCOPE, _guarded, trivial_app
except ImportError:  # a checkout from before the benchmarks moved into chaos/bench/
    from guard.bench import _BODY, _SCOPE, _guarded, trivial_app

async def drive(app, num, wall_ns, cpu_ns):
    message = {"type": "http.request", "body": _BODY, "more_body": False}
    async def receive():
        return message
    async def send(_):
        pass
    cpu_start = time.thread_time_ns()
    for _ in range(num):
        start = time.perf_counter_ns()
        await app(_SCOPE, receive, send)
        wall_ns.append(time.perf_counter_ns() - start)
        await asyncio.sleep(0)
    cpu_ns.append((time.thread_time_ns() - cpu_start) / num)

async def main(iterations, block, policy):
    guard = _guarded(policy)
    wall = {"bare": [], "guarded": []}
    cpu = {"bare": [], "guarded": []}
    await drive(trivial_app, min(block, iterations), [], [])
    await drive(guard, min(block, iterations), [], [])
    for done in range(0, iterations, block):
        n = min(block, iterations - done)
        await drive(trivial_app, n, wall["bare"], cpu["bare"])
        await drive(guard, n, wall["guarded"], cpu["guarded"])
    await guard.aclose()
    median = statistics.median
    return {"added_median_us": (median(wall["guarded"]) - median(wall["bare"])) / 1e3,
            "added_cpu_us": (median(cpu["guarded"]) - median(cpu["bare"])) / 1e3}

a = json.loads(sys.argv[1])
r = asyncio.run(main(a["iterations"], a["block"], a["policy"]))
print("KVGUARD-BENCH " + json.dumps(r))
"""


def _one_round(root: Path, iterations: int, block: int, policy: str, timeout_s: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root)}
    args = json.dumps({"iterations": iterations, "block": block, "policy": policy})
    done = subprocess.run([sys.executable, "-c", _ROUND, args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("KVGUARD-BENCH "):
            return json.loads(line.removeprefix("KVGUARD-BENCH "))
    raise RuntimeError(f"bench round in {root} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def measure_against(baseline: str, iterations: int, block: int, policy: str,
                    rounds: int = 5, timeout_s: float = 600.0) -> dict:
    """Alternating rounds of the in-process bench on this checkout and on ``baseline``."""
    current_root = Path(__file__).resolve().parents[2]
    baseline_root = Path(baseline).resolve()
    if not any((baseline_root / path).is_file() for path in ("chaos/bench/guard.py",
                                                              "guard/bench.py")):
        raise ValueError(f"--against: {baseline!r} is not a kvguard checkout (no "
                         "chaos/bench/guard.py, nor guard/bench.py from before it moved)")
    if rounds < 1:
        raise ValueError("--rounds must be >= 1")
    added: dict[str, list[float]] = {"current": [], "baseline": []}
    cpu: dict[str, list[float]] = {"current": [], "baseline": []}
    sides = [("current", current_root), ("baseline", baseline_root)]
    for index in range(rounds):
        for label, root in sides if index % 2 == 0 else sides[::-1]:
            result = _one_round(root, iterations, block, policy, timeout_s)
            added[label].append(result["added_median_us"])
            cpu[label].append(result["added_cpu_us"])
    current = statistics.median(added["current"])
    base = statistics.median(added["baseline"])
    current_cpu = statistics.median(cpu["current"])
    base_cpu = statistics.median(cpu["baseline"])
    return {"policy": policy, "rounds": rounds, "iterations": iterations,
            "baseline_path": str(baseline_root), "added_median_us": added,
            "current_us": current, "baseline_us": base,
            "ratio": current / base if base > 0 else float("inf"),
            "cpu": {"added_cpu_us": cpu, "current_us": current_cpu, "baseline_us": base_cpu,
                    "ratio": current_cpu / base_cpu if base_cpu > 0 else float("inf")}}


def render_against(result: dict) -> str:
    lines = [f"side by side ({result['rounds']} alternating rounds × {result['iterations']} "
             f"requests, policy {result['policy']}):"]
    for label in ("current", "baseline"):
        rounds = ", ".join(f"{us:.1f}" for us in result["added_median_us"][label])
        lines.append(f"  {label:<9} added median {result[label + '_us']:7.1f} µs   (rounds: {rounds})")
    lines.append(f"  ratio current / baseline = {result['ratio']:.2f}  "
                 f"(baseline: {result['baseline_path']})")
    cpu = result["cpu"]
    lines.append("  thread CPU time per request (added, median over blocks):")
    for label in ("current", "baseline"):
        rounds = ", ".join(f"{us:.1f}" for us in cpu["added_cpu_us"][label])
        lines.append(f"  {label:<9} added CPU    {cpu[label + '_us']:7.1f} µs   (rounds: {rounds})")
    lines.append(f"  CPU ratio current / baseline = {cpu['ratio']:.2f}")
    return "\n".join(lines)
