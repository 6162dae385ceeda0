"""The cost of a run's windows, for the reports of ``kvguard load``, ``bench overload``,
``chaos run`` and ``review``: the replicas' step traces, the requests' fates and the prices.

Sim replicas run ``time_scale`` wall seconds per GPU second, so their windows are priced per
GPU second (:func:`gpu_time_prices`): a window of W wall seconds costs what W ÷ time_scale
seconds of the real GPU would. Without a ``[cost]`` table the prices are the defaults for the
run's ``--gpu`` kind (``guard.observe.cost_config``). A run whose replicas left no step trace
gets no numbers, and the report says why (:func:`unavailable`), rather than calling every
second idle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path

from chaos.cost import Fleet, RequestFate, window_cost
from chaos.cost_inputs import read_jsonl, steps_from_lines
from chaos.goodput import Window
from guard.observe.cost_config import CostConfig

__all__ = ["gpu_time_prices", "priced_windows", "unavailable"]


def gpu_time_prices(cost: CostConfig, k: float) -> CostConfig:
    """Prices per wall second of a sim running ``k`` wall seconds per GPU second."""
    if not k > 0:
        raise ValueError(f"time scale must be > 0, got {k}")
    return dataclasses.replace(
        cost, accelerator_usd_per_hour=cost.accelerator_usd_per_s * 3600 / k,
        host_usd_per_hour=cost.host_usd_per_hour / k)


def unavailable(reason: str) -> dict:
    """A cost block with no numbers: what the report prints instead of a table."""
    return {"windows": [], "unavailable": reason}


def priced_windows(windows: Sequence[tuple[str | None, Window]], t0_s: float,
                   step_traces: Sequence[str | Path], fates: Iterable[RequestFate],
                   config: CostConfig, *, time_scale: float = 1.0, model: str = "llama-7b",
                   num_replicas: int | None = None, num_guards: int = 1) -> dict:
    """The cost block of a report: one priced window per ``(label, window)`` (run seconds from
    ``t0_s``, the run's start on the traces' monotonic clock). ``step_traces``: one file per
    replica, in replica order."""
    from chaos.cost_cli import roofline_weights

    paths = [Path(p) for p in step_traces]
    missing = [str(p) for p in paths if not p.exists()]
    if not paths or missing:
        return unavailable("no engine step trace" + (f" ({', '.join(missing)} missing)"
                                                     if missing else ""))
    steps = [s for i, p in enumerate(paths) for s in steps_from_lines(read_jsonl(p), f"r{i}")]
    fates = list(fates)
    if not steps and any(f.fate in ("good", "late") for f in fates):
        return unavailable("the step traces hold no engine step, yet requests were answered")
    prices = gpu_time_prices(config, time_scale)
    weights = roofline_weights(model, config.gpu)
    replicas = len(paths) if num_replicas is None else num_replicas
    out = []
    for label, w in windows:
        doc = window_cost(Window(t0_s + w.start_s, t0_s + w.end_s), steps, fates, prices,
                          Fleet(replicas, num_guards), weights).to_dict()
        doc["window_s"] = [w.start_s, w.end_s]
        if label is not None:
            doc["label"] = label
        out.append(doc)
    return {"windows": out, "gpu": config.gpu, "time_scale": time_scale,
            "accelerator_usd_per_gpu_hour": config.accelerator_usd_per_s * 3600}
