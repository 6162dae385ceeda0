"""Prefix-cache hit ratios over one bench run: what the engines measured and what the guard
predicted, each from counters scraped before and after the run.

* engine-measured: ``vllm:prefix_cache_hits_total`` ÷ ``vllm:prefix_cache_queries_total``
  (prompt tokens), summed over the replicas' ``/metrics``;
* guard-predicted: ``kvguard_prefix_cache_predicted_tokens_total`` ÷
  ``kvguard_prefix_cache_routed_prompt_tokens_total`` from the guard's metrics page (the
  share of the routed prompt tokens its prefix-cache view expected cached).
"""

from __future__ import annotations

from collections.abc import Sequence

from chaos.server_metrics import family_total, scrape

__all__ = ["CacheCounts", "engine_counts", "guard_counts", "hit_ratio"]

CacheCounts = tuple[float, float]  # (hit tokens, query tokens)


def engine_counts(replica_urls: Sequence[str]) -> CacheCounts | None:
    """The replicas' prefix-cache hits and queries, summed (None if one has no such page)."""
    hits = queries = 0.0
    for url in replica_urls:
        samples = scrape(url.rstrip("/") + "/metrics")
        if samples is None:
            return None
        h = family_total(samples, "vllm:prefix_cache_hits_total")
        q = family_total(samples, "vllm:prefix_cache_queries_total")
        if h is None or q is None:
            return None
        hits, queries = hits + h, queries + q
    return hits, queries


def guard_counts(metrics_url: str) -> CacheCounts | None:
    """The guard's predicted cached tokens and routed prompt tokens (None without them)."""
    samples = scrape(metrics_url)
    if samples is None:
        return None
    cached = family_total(samples, "kvguard_prefix_cache_predicted_tokens_total")
    routed = family_total(samples, "kvguard_prefix_cache_routed_prompt_tokens_total")
    if routed is None:
        return (0.0, 0.0) if samples else None
    return cached or 0.0, routed


def hit_ratio(before: CacheCounts | None, after: CacheCounts | None) -> float | None:
    """Hits ÷ queries between two scrapes (None when either is missing or nothing was asked;
    a restart between them — counters lower after — counts from zero)."""
    if after is None:
        return None
    hits, queries = after
    if before is not None and before[1] <= queries:
        hits, queries = hits - before[0], queries - before[1]
    return hits / queries if queries > 0 else None
