"""Prometheus gauges of the guard's prefix-cache view, read when scraped.

* ``kvguard_prefix_cache_predicted_hit_ratio{replica}`` — the share of routed prompt tokens
  the view expected the replica to have cached;
* ``kvguard_prefix_cache_measured_hit_ratio{replica}`` — the engine's own hit ratio over the
  same period (its prefix-cache counters' rise);
* ``kvguard_prefix_cache_tracked_blocks{replica}`` — blocks (or chunks) the view tracks;
* ``kvguard_prefix_cache_predicted_tokens_total{replica}`` and
  ``kvguard_prefix_cache_routed_prompt_tokens_total{replica}`` — the sums behind the predicted
  ratio, over the guard's life (so a bench can take the ratio over its own window);
* ``kvguard_prefix_cache_unrendered_chats_total`` — chat requests the precise view priced as
  uncached because the ``chat_template`` could not render them as the replica would;
* ``kvguard_kv_events_dropped_total`` — KV event batches dropped as malformed or from an
  unknown replica;
* ``kvguard_kv_events_untranslated_total`` — stored-block events of replicas that are not
  kvguard engines (vLLM) the view could not translate into kvguard's chain
  (:mod:`guard.replicas.kv_event_translation`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from guard.replicas.prefix_cache import PrefixCacheView

__all__ = ["PrefixCacheCollector"]


class PrefixCacheCollector(Collector):
    def __init__(self, view: PrefixCacheView, num_dropped: Callable[[], int] | None = None,
                 num_untranslated: Callable[[], int] | None = None):
        self.view = view
        self.num_dropped = num_dropped
        self.num_untranslated = num_untranslated

    def collect(self) -> Iterator:
        view = self.view
        predicted = GaugeMetricFamily(
            "kvguard_prefix_cache_predicted_hit_ratio",
            "Share of routed prompt tokens the guard expected cached on the replica",
            labels=["replica"])
        measured = GaugeMetricFamily(
            "kvguard_prefix_cache_measured_hit_ratio",
            "The replica engine's prefix-cache hit ratio over the same period",
            labels=["replica"])
        tracked = GaugeMetricFamily(
            "kvguard_prefix_cache_tracked_blocks",
            "Blocks the guard's prefix-cache view tracks for the replica", labels=["replica"])
        for replica_id in sorted(set(view.replica_ids()) | set(view.index.replica_ids())):
            ratio = view.predicted_hit_ratio(replica_id)
            if ratio is not None:
                predicted.add_metric([replica_id], ratio)
            ratio = view.measured_hit_ratio(replica_id)
            if ratio is not None:
                measured.add_metric([replica_id], ratio)
            tracked.add_metric([replica_id], view.index.num_blocks(replica_id))
        yield predicted
        yield measured
        yield tracked
        cached = CounterMetricFamily(
            "kvguard_prefix_cache_predicted_tokens",
            "Prompt tokens the guard expected cached where it routed them", labels=["replica"])
        routed = CounterMetricFamily(
            "kvguard_prefix_cache_routed_prompt_tokens",
            "Prompt tokens routed to the replica", labels=["replica"])
        for replica_id, (num_cached, num_routed) in sorted(view.totals.items()):
            cached.add_metric([replica_id], num_cached)
            routed.add_metric([replica_id], num_routed)
        yield cached
        yield routed
        if view.mode == "precise":
            unrendered = CounterMetricFamily(
                "kvguard_prefix_cache_unrendered_chats",
                "Chat requests priced uncached: the chat template could not render them")
            unrendered.add_metric([], view.num_unrendered_chats)
            yield unrendered
        if self.num_dropped is not None:
            dropped = CounterMetricFamily("kvguard_kv_events_dropped",
                                          "KV event batches dropped (malformed or unknown replica)")
            dropped.add_metric([], self.num_dropped())
            yield dropped
        if self.num_untranslated is not None:
            untranslated = CounterMetricFamily(
                "kvguard_kv_events_untranslated",
                "Stored-block events of non-kvguard replicas not tracked (unknown parent, "
                "unknown model, LoRA or extra-keyed blocks)")
            untranslated.add_metric([], self.num_untranslated())
            yield untranslated
