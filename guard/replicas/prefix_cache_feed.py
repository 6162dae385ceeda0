"""``PrefixCacheFeed``: the guard's prefix-cache view wired to what feeds and reads it.

Built by the controller from its config: the view (:mod:`guard.replicas.prefix_cache`) told
of every replica state and admission (through :class:`~guard.replicas.load_state.LoadState`),
read by the pricer, exported on the guard's registry; in precise mode, the KV-cache event
subscriptions (:mod:`guard.replicas.kv_events`) — each replica's configured
``kv_events_endpoint`` from :meth:`start`, or the one its state document advertises once seen.
With ``prefix_cache = "off"`` it holds nothing and does nothing.

Whose block hashes a replica's events carry is told by where its state comes from: a replica
read as a kvguard engine (``state_source`` ``kvguard``, ``stream`` or ``asgi``; an ``auto``
one once it has answered with a kvguard state document; the middleware's own app) publishes
kvguard's chain, applied as it is; every other replica (``vllm``, and any other engine that
publishes vLLM's events) is translated into kvguard's chain
(:mod:`guard.replicas.kv_event_translation`), rooted at its model: its ``[[replicas]]
models`` first name, else the model its metrics or state name.
"""

from __future__ import annotations

from collections.abc import Collection

from prometheus_client import CollectorRegistry

from guard.config import GuardConfig
from guard.observe.prefix_cache_metrics import PrefixCacheCollector
from guard.replicas.block_hashes import root_hash
from guard.replicas.kv_event_translation import BlockTranslator
from guard.replicas.kv_events import KvEvents, KvEventSubscriber, resolve_endpoint
from guard.replicas.load_state import LoadState
from guard.replicas.prefix_cache import PrefixCacheView, build_prefix_view

__all__ = ["PrefixCacheFeed"]

# state sources that read a kvguard engine (its KV events carry kvguard's own block hashes)
_KVGUARD_SOURCES = frozenset({"kvguard", "stream", "asgi"})


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
        self.translator: BlockTranslator | None = None
        self._urls = {r.replica_id: r.url for r in config.replicas}
        if self.view is None:
            return
        load_state.cache_view = self.view
        pricer.prefix_view = self.view
        if config.prefix_cache == "precise":
            known = set(self._urls) | set(replica_ids or ())
            self._translated = {r.replica_id for r in config.replicas
                                if r.state_source not in _KVGUARD_SOURCES}
            self._models = {r.replica_id: r.models[0] for r in config.replicas if r.models}
            self.translator = BlockTranslator(self.view.index, self._root_of)
            self.events = KvEvents(self.view.index, known, translated=self._translated.__contains__,
                                   translator=self.translator)
            self.subscriber = KvEventSubscriber(self.events, on_gap=self.view.forget)
            self.view.on_events_endpoint = self._advertised
            self.view.on_kvguard_state = self._kvguard_engine
            self.view.on_forget = self.translator.forget
        registry.register(PrefixCacheCollector(
            self.view, (lambda: self.events.num_dropped) if self.events is not None else None,
            (lambda: self.translator.num_untranslated) if self.translator is not None else None))

    def start(self) -> None:
        """Subscribe to every configured ``kv_events_endpoint`` (precise mode, on the loop)."""
        if self.subscriber is None:
            return
        for replica in self.config.replicas:
            if replica.kv_events_endpoint is not None:
                self.subscriber.subscribe(replica.replica_id, replica.kv_events_endpoint)

    def _root_of(self, replica_id: str) -> int | None:
        """The kvguard root of a translated replica's chains (None: its model is unknown)."""
        model = self._models.get(replica_id) or self.view.replica_models.get(replica_id)
        return root_hash(model) if model else None

    def _kvguard_engine(self, replica_id: str) -> None:
        """The replica answered with a kvguard state document: its events are kvguard's own
        hashes from now on (an ``auto`` replica found to be a kvguard engine)."""
        if replica_id in self._translated:
            self._translated.discard(replica_id)
            self.view.forget(replica_id)  # what was translated is in another chain's terms

    def _advertised(self, replica_id: str, endpoint: str) -> None:
        configured = next((r.kv_events_endpoint for r in self.config.replicas
                           if r.replica_id == replica_id), None)
        if configured is None and self.subscriber is not None:
            self.subscriber.subscribe(replica_id,
                                      resolve_endpoint(endpoint, self._urls.get(replica_id)))

    async def aclose(self) -> None:
        if self.subscriber is not None:
            await self.subscriber.aclose()
