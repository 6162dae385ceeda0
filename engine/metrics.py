"""Prometheus metrics of one engine replica, named like vLLM's so vLLM dashboards can watch us.

Names and labels follow vLLM's v1 Prometheus logger (``model_name`` label; counters exposed
with the ``_total`` suffix that prometheus-client appends, e.g. ``vllm:num_preemptions_total``,
``vllm:request_success_total{finished_reason=...}``; ``vllm:cache_config_info`` is a gauge of 1
whose labels carry ``block_size``, ``num_gpu_blocks`` and ``enable_prefix_caching``;
``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` count prompt tokens
looked up in / found in the prefix cache, as vLLM v1 counts them). Histogram buckets are
vLLM's, with a few finer low buckets added because the CPU test models step in well under
10 ms.

kvguard adds KV block gauges and request outcome counters so a client can reconcile::

    kvguard_engine_requests_received = vllm:request_success (stop + length)
                              + kvguard_engine_requests_rejected + kvguard_engine_requests_failed
                              + kvguard_engine_requests_aborted + (requests still in flight)
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest

__all__ = ["EngineMetrics"]

_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                   0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS_S = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                  30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_SUCCESS_REASONS = ("stop", "length")


class EngineMetrics:
    """All metrics of one replica, registered on an injected registry (no globals)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        self.model_name = model_name
        labels = ["model_name"]
        self._running = Gauge("vllm:num_requests_running", "Requests in model execution batches",
                              labels, registry=registry)
        self._waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed",
                              labels, registry=registry)
        self._kv_usage = Gauge("vllm:kv_cache_usage_perc",
                               "KV-cache usage. 1 means 100 percent usage", labels,
                               registry=registry)
        self._total_blocks = Gauge("kvguard_engine_num_total_kv_blocks", "KV blocks in the pool",
                                   labels, registry=registry)
        self._free_blocks = Gauge("kvguard_engine_num_free_kv_blocks", "KV blocks free now",
                                  labels, registry=registry)
        self._preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemptions",
                                    labels, registry=registry)
        self._prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed",
                                      labels, registry=registry)
        self._generation_tokens = Counter("vllm:generation_tokens",
                                          "Number of generation tokens processed", labels,
                                          registry=registry)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests",
                                labels + ["finished_reason"], registry=registry)
        self._ttft = Histogram("vllm:time_to_first_token_seconds",
                               "Histogram of time to first token in seconds", labels,
                               buckets=_TTFT_BUCKETS_S, registry=registry)
        self._tpot = Histogram("vllm:time_per_output_token_seconds",
                               "Histogram of time per output token in seconds", labels,
                               buckets=_TPOT_BUCKETS_S, registry=registry)
        self._e2e = Histogram("vllm:e2e_request_latency_seconds",
                              "Histogram of end to end request latency in seconds", labels,
                              buckets=_E2E_BUCKETS_S, registry=registry)
        self._queue = Histogram("vllm:request_queue_time_seconds",
                                "Histogram of time spent in WAITING phase for request", labels,
                                buckets=_E2E_BUCKETS_S, registry=registry)
        self._cache_info = Gauge("vllm:cache_config_info", "Information of the engine CacheConfig",
                                 ["block_size", "num_gpu_blocks", "enable_prefix_caching"],
                                 registry=registry)
        self._prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens", labels,
            registry=registry)
        self._prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens",
            labels, registry=registry)
        self._received = Counter("kvguard_engine_requests_received", "Generation requests received",
                                 labels, registry=registry)
        self._rejected = Counter("kvguard_engine_requests_rejected",
                                 "Requests refused before reaching the engine (validation, "
                                 "shutdown)", labels + ["status"], registry=registry)
        self._aborted = Counter("kvguard_engine_requests_aborted",
                                "Requests canceled by the client (disconnect) or by shutdown",
                                labels, registry=registry)
        self._failed = Counter("kvguard_engine_requests_failed", "Requests failed by an engine error",
                               labels, registry=registry)
        self._connections_closed = Counter(
            "kvguard_engine_connections_closed", "Connections the server closed or refused "
            "(header_timeout, body_timeout, write_timeout, over_capacity)", ["reason"],
            registry=registry)
        for reason in ("header_timeout", "body_timeout", "write_timeout", "over_capacity"):
            self._connections_closed.labels(reason=reason)
        self._last_num_preemptions = 0
        self._last_prefix_queries = self._last_prefix_hits = 0
        for metric in (self._running, self._waiting, self._kv_usage, self._total_blocks,
                       self._free_blocks, self._preemptions, self._prompt_tokens,
                       self._generation_tokens, self._ttft, self._tpot, self._e2e, self._queue,
                       self._received, self._aborted, self._failed, self._prefix_queries,
                       self._prefix_hits):
            self._m(metric)  # export every series from the start, at zero
        for reason in _SUCCESS_REASONS:
            self._success.labels(model_name=model_name, finished_reason=reason)

    def _m(self, metric):
        return metric.labels(model_name=self.model_name)

    def set_cache_config(self, block_size: int, num_blocks: int,
                         enable_prefix_caching: bool) -> None:
        self._cache_info.labels(block_size=str(block_size), num_gpu_blocks=str(num_blocks),
                                enable_prefix_caching=str(enable_prefix_caching)).set(1)

    def observe_state(self, state: Mapping) -> None:
        """Refresh the gauges (and the preemption counter) from an engine ``state()`` dict."""
        total = int(state.get("num_total_blocks", 0))
        free = int(state.get("num_free_blocks", 0))
        self._m(self._running).set(len(state.get("running", ())))
        self._m(self._waiting).set(len(state.get("waiting", ())))
        self._m(self._total_blocks).set(total)
        self._m(self._free_blocks).set(free)
        self._m(self._kv_usage).set((total - free) / total if total else 0.0)
        preemptions = int(state.get("num_preemptions", 0))
        if preemptions > self._last_num_preemptions:
            self._m(self._preemptions).inc(preemptions - self._last_num_preemptions)
        self._last_num_preemptions = max(preemptions, self._last_num_preemptions)
        queries = int(state.get("prefix_cache_queries", 0))
        hits = int(state.get("prefix_cache_hits", 0))
        if queries > self._last_prefix_queries:
            self._m(self._prefix_queries).inc(queries - self._last_prefix_queries)
            self._last_prefix_queries = queries
        if hits > self._last_prefix_hits:
            self._m(self._prefix_hits).inc(hits - self._last_prefix_hits)
            self._last_prefix_hits = hits

    def record_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        if num_prompt_tokens:
            self._m(self._prompt_tokens).inc(num_prompt_tokens)
        if num_generation_tokens:
            self._m(self._generation_tokens).inc(num_generation_tokens)

    def record_received(self) -> None:
        self._m(self._received).inc()

    def record_rejected(self, status: int) -> None:
        self._rejected.labels(model_name=self.model_name, status=str(status)).inc()

    def record_aborted(self) -> None:
        self._m(self._aborted).inc()

    def record_connection_closed(self, reason: str) -> None:
        self._connections_closed.labels(reason=reason).inc()

    def record_failed(self) -> None:
        self._m(self._failed).inc()

    def record_finished(self, finish_reason: str, *, ttft_s: float | None, e2e_s: float,
                        queue_s: float | None, num_output_tokens: int) -> None:
        """A request the engine completed (``stop`` or ``length``)."""
        if finish_reason not in _SUCCESS_REASONS:
            raise ValueError(f"finish_reason must be one of {_SUCCESS_REASONS}, got "
                             f"{finish_reason!r}")
        self._success.labels(model_name=self.model_name, finished_reason=finish_reason).inc()
        self._m(self._e2e).observe(e2e_s)
        if ttft_s is not None:
            self._m(self._ttft).observe(ttft_s)
            if num_output_tokens > 1:
                self._m(self._tpot).observe((e2e_s - ttft_s) / (num_output_tokens - 1))
        if queue_s is not None:
            self._m(self._queue).observe(queue_s)

    def attach_gpu_meter(self, meter) -> None:
        """Export an ``engine.gpu_meter.GpuMeter``: model FLOPs and HBM bytes (counters),
        memory by use, power (gauges) and energy (counter), power and energy labelled with
        ``source`` (``measured`` or ``modelled``)."""
        self.registry.register(_GpuCollector(meter, self.model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _GpuCollector:
    def __init__(self, meter, model_name: str) -> None:
        self._meter, self._model_name = meter, model_name

    def collect(self):
        m, name = self._meter, self._model_name
        flops = CounterMetricFamily("kvguard_engine_model_flops", "Model FLOPs of the executed "
                                    "steps (roofline count)", labels=["model_name"])
        flops.add_metric([name], m.flops)
        hbm = CounterMetricFamily("kvguard_engine_hbm_bytes", "HBM bytes the executed steps "
                                  "moved (roofline count)", labels=["model_name"])
        hbm.add_metric([name], m.hbm_bytes)
        memory = GaugeMetricFamily("kvguard_engine_memory_bytes", "Device memory by use "
                                   "(weights, kv, workspace, reserve)", labels=["model_name", "kind"])
        for kind, value in m.memory.as_dict().items():
            memory.add_metric([name, kind], value)
        power = GaugeMetricFamily("kvguard_engine_power_watts", "Accelerator power (measured by "
                                  "NVML or modelled from the roofline utilisation)",
                                  labels=["model_name", "source"])
        power.add_metric([name, m.source], m.power_w())
        energy = CounterMetricFamily("kvguard_engine_energy_joules", "Accelerator energy since "
                                     "start", labels=["model_name", "source"])
        energy.add_metric([name, m.source], m.energy_j())
        yield from (flops, hbm, memory, power, energy)
