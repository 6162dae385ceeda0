"""``kvguard bench guard --against DIR``: this checkout's guard and another checkout's, side by
side in one run.

Two versions of the ``guard`` package cannot share one interpreter, so each round runs the
in-process measurement (:func:`guard.bench.measure_in_process`: bare app vs guarded app, the
guard's added median) once per checkout, each in a fresh interpreter whose ``PYTHONPATH`` is that
checkout, alternating which goes first so drift hits both equally. The result is the median of
each side's per-round added median and their ratio (current ÷ baseline: below 1 is faster).

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

_ROUND = (
    "import asyncio, json, sys\n"
    "from guard.bench import measure_in_process\n"
    "a = json.loads(sys.argv[1])\n"
    "r = asyncio.run(measure_in_process(a['iterations'], a['block'], a['policy']))\n"
    "print('KVGUARD-BENCH ' + json.dumps(r))\n"
)


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
    current_root = Path(__file__).resolve().parents[1]
    baseline_root = Path(baseline).resolve()
    if not (baseline_root / "guard" / "bench.py").is_file():
        raise ValueError(f"--against: {baseline!r} is not a kvguard checkout (no guard/bench.py)")
    if rounds < 1:
        raise ValueError("--rounds must be >= 1")
    added: dict[str, list[float]] = {"current": [], "baseline": []}
    sides = [("current", current_root), ("baseline", baseline_root)]
    for index in range(rounds):
        for label, root in sides if index % 2 == 0 else sides[::-1]:
            result = _one_round(root, iterations, block, policy, timeout_s)
            added[label].append(result["added_median_us"])
    current = statistics.median(added["current"])
    base = statistics.median(added["baseline"])
    return {"policy": policy, "rounds": rounds, "iterations": iterations,
            "baseline_path": str(baseline_root), "added_median_us": added,
            "current_us": current, "baseline_us": base,
            "ratio": current / base if base > 0 else float("inf")}


def render_against(result: dict) -> str:
    lines = [f"side by side ({result['rounds']} alternating rounds × {result['iterations']} "
             f"requests, policy {result['policy']}):"]
    for label in ("current", "baseline"):
        rounds = ", ".join(f"{us:.1f}" for us in result["added_median_us"][label])
        lines.append(f"  {label:<9} added median {result[label + '_us']:7.1f} µs   (rounds: {rounds})")
    lines.append(f"  ratio current / baseline = {result['ratio']:.2f}  "
                 f"(baseline: {result['baseline_path']})")
    return "\n".join(lines)
