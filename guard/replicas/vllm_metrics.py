"""The load figures kvguard reads from a black-box vLLM replica's Prometheus ``/metrics``."""

from __future__ import annotations

import re

__all__ = ["parse_vllm_metrics", "served_model_name"]

_MODEL_LABEL = re.compile(r'\bmodel_name="((?:[^"\\]|\\.)*)"')

_VLLM_GAUGES = {
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage_ratio",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage_ratio",  # the name before vLLM v0.10
}
# prefix-cache counters (vLLM v1, tokens): summed over engines, absent on older vLLM
_VLLM_COUNTERS = {
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
}
_INFO_LABELS = ("block_size", "num_gpu_blocks", "max_model_len", "max_num_seqs",
                "max_num_batched_tokens")


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """The load figures in a vLLM ``/metrics`` text; ValueError when a required one is missing.

    Request counts are summed over label sets (several engines); KV usage (a 0–1 fraction despite
    the ``_perc`` name) is averaged. ``block_size`` and friends come from ``*_info`` labels.
    """
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, list[float]] = {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = _VLLM_GAUGES.get(sample.name) or _VLLM_COUNTERS.get(sample.name)
            if key is not None:
                sums.setdefault(key, []).append(float(sample.value))
            elif sample.name.endswith("_info"):
                for label in _INFO_LABELS:
                    if label in sample.labels and sample.labels[label] not in ("", "None"):
                        out[label] = float(sample.labels[label])
    for key, values in sums.items():
        out[key] = sum(values) / len(values) if key == "kv_cache_usage_ratio" else sum(values)
    missing = [k for k in ("num_requests_running", "num_requests_waiting",
                           "kv_cache_usage_ratio", "num_gpu_blocks") if k not in out]
    if missing:
        raise ValueError(f"vLLM metrics lack {', '.join(missing)}")
    return out


def served_model_name(text: str) -> str | None:
    """The ``model_name`` label vLLM puts on its metrics (its first served model name), or
    None: the precise prefix view roots the blocks translated from its events there."""
    match = _MODEL_LABEL.search(text)
    return match.group(1) if match and match.group(1) else None
