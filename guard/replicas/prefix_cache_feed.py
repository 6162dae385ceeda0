"""``PrefixCacheFeed``: the guard's prefix-cache view wired to what feeds and reads it.

Built by the controller from its config: the view (:mod:`guard.replicas.prefix_cache`) told
of every replica state and admission (through :class:`~guard.replicas.load_state.LoadState`),
read by the pricer, exported on the guard's registry; in precise mode, the KV-cache event
subscriptions (:mod:`guard.replicas.kv_events`) — each replica's configured
``kv_events_endpoint`` from :meth:`start`, or the one its state document advertises once seen.
With ``prefix_cache = "off"`` it holds nothing and does nothing.
"""

from __future__ import annotations

from collections.abc import Collection

from prometheus_client import CollectorRegistry

from guard.config import GuardConfig
from guard.observe.prefix_cache_metrics import PrefixCacheCollector
from guard.replicas.kv_events import KvEvents, KvEventSubscriber, resolve_endpoint
from guard.replicas.load_state import LoadState
from guard.replicas.prefix_cache import PrefixCacheView, build_prefix_view

__all__ = ["PrefixCacheFeed"]


class PrefixCacheFeed:
    def __init__(self, config: GuardConfig, load_state: LoadState, pricer: object,
                 registry: CollectorRegistry, replica_ids: Collection[str] | None = None) -> None:
        self.config = config
        token_ids = None
        if config.prefix_cache == "precise":
            from guard.request.pricing import tokenizer_ids

            token_ids = tokenizer_ids(config.tokenizer)
        self.view: PrefixCacheView | None = build_prefix_view(config, token_ids)
        self.events: KvEvents | None = None
        self.subscriber: KvEventSubscriber | None = None
        self._urls = {r.replica_id: r.url for r in config.replicas}
        if self.view is None:
            return
        load_state.cache_view = self.view
        pricer.prefix_view = self.view
        if config.prefix_cache == "precise":
            known = set(self._urls) | set(replica_ids or ())
            self.events = KvEvents(self.view.index, known)
            self.subscriber = KvEventSubscriber(self.events, on_gap=self.view.forget)
            self.view.on_events_endpoint = self._advertised
        registry.register(PrefixCacheCollector(
            self.view, (lambda: self.events.num_dropped) if self.events is not None else None))

    def start(self) -> None:
        """Subscribe to every configured ``kv_events_endpoint`` (precise mode, on the loop)."""
        if self.subscriber is None:
            return
        for replica in self.config.replicas:
            if replica.kv_events_endpoint is not None:
                self.subscriber.subscribe(replica.replica_id, replica.kv_events_endpoint)

    def _advertised(self, replica_id: str, endpoint: str) -> None:
        configured = next((r.kv_events_endpoint for r in self.config.replicas
                           if r.replica_id == replica_id), None)
        if configured is None and self.subscriber is not None:
            self.subscriber.subscribe(replica_id,
                                      resolve_endpoint(endpoint, self._urls.get(replica_id)))

    async def aclose(self) -> None:
        if self.subscriber is not None:
            await self.subscriber.aclose()
