"""The load figures kvguard reads from SGLang, TGI and llama.cpp servers' Prometheus ``/metrics``.

Each engine names its gauges its own way; all of them reduce to one :class:`EngineLoad`
(requests running, requests waiting, and, where the engine says, how full its KV cache is and
how large). The names, as the engines' own sources define them:

* SGLang (``python/sglang/srt/metrics/collector.py``, ``--enable-metrics``):
  ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage`` (a 0–1
  fraction of the KV pool) and ``sglang:max_total_num_tokens`` (the pool, in tokens).
* TGI (the router's batcher, ``backends/v3``): ``tgi_batch_current_size`` (requests in the
  running batch) and ``tgi_queue_size`` (waiting); no KV figure.
* llama.cpp server (``tools/server``, ``--metrics``): ``llamacpp:requests_processing`` and
  ``llamacpp:requests_deferred``; ``llamacpp:kv_cache_usage_ratio`` only from builds before
  its KV cache was unified (newer ones no longer export it), so it is optional. Without
  ``--metrics`` its ``GET /slots`` (on by default) lists one object per slot, each with
  ``is_processing`` (older builds: ``state``, 0 idle): the slot count and how many are busy
  (:func:`parse_llamacpp_slots`; it shows no waiting requests).

Counts are summed over label sets (several data-parallel ranks or models); usage ratios are
averaged. A page that lacks a required gauge raises ``ValueError`` naming what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ENGINE_METRICS", "EngineLoad", "detect_metrics_engine", "parse_engine_metrics",
           "parse_llamacpp_slots"]


@dataclass(frozen=True)
class EngineLoad:
    """What one engine's ``/metrics`` page says about its load; None where it says nothing."""

    engine: str
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_ratio: float | None = None
    num_kv_tokens: int | None = None  # the KV pool's size in tokens
    num_slots: int | None = None  # sequences it runs at once (llama.cpp's slots)


# engine -> (metric name -> EngineLoad field); the first two fields are required
ENGINE_METRICS: dict[str, dict[str, str]] = {
    "sglang": {
        "sglang:num_running_reqs": "num_requests_running",
        "sglang:num_queue_reqs": "num_requests_waiting",
        "sglang:token_usage": "kv_cache_usage_ratio",
        "sglang:max_total_num_tokens": "num_kv_tokens",
    },
    "tgi": {
        "tgi_batch_current_size": "num_requests_running",
        "tgi_queue_size": "num_requests_waiting",
    },
    "llamacpp": {
        "llamacpp:requests_processing": "num_requests_running",
        "llamacpp:requests_deferred": "num_requests_waiting",
        "llamacpp:kv_cache_usage_ratio": "kv_cache_usage_ratio",
    },
}
_REQUIRED = ("num_requests_running", "num_requests_waiting")
_AVERAGED = ("kv_cache_usage_ratio",)
# the prefix that marks each format's page (vLLM's too, so detection can tell them apart)
_PREFIXES = (("vllm", "vllm:"), ("sglang", "sglang:"), ("llamacpp", "llamacpp:"),
             ("tgi", "tgi_"))


def detect_metrics_engine(text: str) -> str | None:
    """Which engine wrote this ``/metrics`` page (``vllm``, ``sglang``, ``tgi``, ``llamacpp``),
    by the prefix of its sample lines; None when no known one appears."""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        for engine, prefix in _PREFIXES:
            if line.startswith(prefix):
                return engine
    return None


def parse_engine_metrics(engine: str, text: str) -> EngineLoad:
    """The load figures in ``engine``'s ``/metrics`` text; ValueError when the page is not
    Prometheus text or lacks a required gauge."""
    names = ENGINE_METRICS.get(engine)
    if names is None:
        raise ValueError(f"engine: must be one of {sorted(ENGINE_METRICS)}, got {engine!r}")
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = names.get(sample.name)
                if key is not None:
                    values.setdefault(key, []).append(float(sample.value))
    except ValueError as exc:
        raise ValueError(f"{engine} metrics are not Prometheus text: {exc}") from None
    missing = [name for name, key in names.items() if key in _REQUIRED and key not in values]
    if missing:
        raise ValueError(f"{engine} metrics lack {', '.join(missing)}")
    figures = {key: (sum(v) / len(v) if key in _AVERAGED else sum(v))
               for key, v in values.items()}
    kv_tokens = figures.get("num_kv_tokens")
    return EngineLoad(
        engine,
        int(figures["num_requests_running"]),
        int(figures["num_requests_waiting"]),
        figures.get("kv_cache_usage_ratio"),
        int(kv_tokens) if kv_tokens else None,
    )


def parse_llamacpp_slots(text: str) -> EngineLoad:
    """llama.cpp server's ``GET /slots`` JSON: ValueError unless it is a list of slot objects."""
    import json

    try:
        slots = json.loads(text)
    except ValueError:
        raise ValueError("llama.cpp /slots is not JSON") from None
    if not isinstance(slots, list) or not slots or not all(isinstance(s, dict) for s in slots):
        raise ValueError("llama.cpp /slots is not a list of slot objects")
    busy = 0
    for slot in slots:
        if "is_processing" in slot:
            busy += bool(slot["is_processing"])
        elif "state" in slot:
            busy += slot["state"] != 0
        else:
            raise ValueError("llama.cpp /slots: a slot has neither is_processing nor state")
    return EngineLoad("llamacpp", busy, 0, num_slots=len(slots))
