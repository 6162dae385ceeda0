"""``PrefixCacheView``: the guard's view of each replica's prefix cache, and what it predicts.

Modes (the guard's ``prefix_cache`` key):

* ``approximate`` (default) — needs nothing from the engine. The prompt is rendered to one
  string (a completion's prompt; a chat's messages, each as its role and text, in order) and
  cut into ``chunk_chars``-character chunks hashed as a chain
  (:func:`guard.replicas.block_hashes.text_chunk_hashes`); a token-id prompt is cut into
  chunks of ``chunk_chars ÷ 4`` ids (the tokens a text chunk holds at a nominal 4 characters
  per token), so the capacity of a replica's view, ``total blocks × block size ÷ that``
  chunks, means the same for both. The replica a request is routed to is assumed to hold its chunks
  from then on. A chunk stands for ``chunk_chars ÷ chars-per-token`` tokens (the pricer's
  calibrated ratio).
* ``precise`` — fed by the replicas' KV-cache events (:mod:`guard.replicas.kv_events`; a
  vLLM replica's translated into kvguard's chain, :mod:`guard.replicas.kv_event_translation`):
  a request's blocks are hashed from its token ids exactly as a kvguard engine hashes them
  (:func:`guard.replicas.block_hashes.token_block_hashes`), which needs the engine's tokenizer
  (the guard's ``tokenizer`` key) and its ``block_size``. Completions prompts (text or token
  ids) are hashed; a chat request is rendered first with the replicas' chat template (the
  guard's ``chat_template`` key, :mod:`guard.request.chat_template`), as the engine renders
  it. Without that key, or for a request the template cannot render as the replica would
  (counted in ``num_unrendered_chats``, the first one logged), a chat request is priced as
  uncached.

Either way a replica's view is bounded by its capacity (its ``num_total_blocks`` from its
state, capped by ``max_blocks_per_replica``) and emptied when the replica restarts: its state
document's ``step_count`` or prefix-cache counters went backwards, or the poller marked it
down.

Sessions: a request with ``x-session-id`` prefers the replica its session last went to — the
view assumes that replica still holds the session's previous prompt (a soft preference: the
policy still weighs it against load).

What it predicts is checked against what the engines measure: per replica, the share of
prompt tokens the view expected to be cached for the requests routed there
(``kvguard_prefix_cache_predicted_hit_ratio``) beside the engine's own hit ratio over the
same period (its ``prefix_cache_hits`` ÷ ``prefix_cache_queries`` in ``/kvguard/state``, or
``vllm:prefix_cache_hits_total`` ÷ ``vllm:prefix_cache_queries_total``).
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from guard.replicas.block_hashes import id_chunk_hashes, text_chunk_hashes, token_block_hashes
from guard.replicas.prefix_index import PrefixIndex
from policies.cost import RequestCost

__all__ = ["MODES", "PrefixCacheView", "PrefixKey", "build_prefix_view", "render_prompt"]

log = logging.getLogger("kvguard.prefix_cache")

MODES = ("off", "approximate", "precise")
_TOKEN_BLOCK = 16  # block size until a replica's state says otherwise
_RENDER = object()  # PrefixCacheView.key: the caller has not rendered the chat request
_NOMINAL_CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class PrefixKey:
    """A request's prefix as the view tracks it: its chained hashes, the tokens one hash
    stands for, and its session (``x-session-id``) if it named one."""

    hashes: tuple[int, ...]
    tokens_per_hash: float
    num_prompt_tokens: int
    session_id: str | None = None


def render_prompt(body: Mapping, is_chat: bool) -> str | list[int]:
    """The prompt as one string (chat: each message's role and text, in order), or a
    completion's token ids. The body is already validated by the pricer."""
    if not is_chat:
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return prompt
    parts = []
    for message in body["messages"]:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<{message['role']}>{content or ''}\n")
    return "".join(parts)


@dataclass
class _Counts:
    """One replica's predicted and measured prompt-token tallies."""

    num_predicted_cached_tokens: int = 0
    num_routed_prompt_tokens: int = 0
    base_queries: float | None = None  # the engine counters when the tally started
    base_hits: float | None = None
    queries: float | None = None
    hits: float | None = None
    step_count: int | None = None


class PrefixCacheView:
    """The prefix-cache view of every replica (one per guard; not thread-safe)."""

    def __init__(self, mode: str = "approximate", *, chunk_chars: int = 256,
                 max_blocks_per_replica: int = 1 << 18, max_sessions: int = 100_000,
                 token_ids: object = None, model: str = "", chat_template: object = None
                 ) -> None:
        if mode not in MODES[1:]:
            raise ValueError(f"prefix_cache: must be one of {MODES[1:]} here, got {mode!r}")
        if isinstance(chunk_chars, bool) or not isinstance(chunk_chars, int) or chunk_chars < 1:
            raise ValueError(f"prefix_cache_chunk_chars: must be an int >= 1, got {chunk_chars!r}")
        if mode == "precise" and token_ids is None:
            raise ValueError("prefix_cache = 'precise' needs the engine's tokenizer "
                             "(the guard's tokenizer key)")
        self.mode = mode
        self.chunk_chars = chunk_chars
        # a token-id prompt's approximate chunk: the tokens a text chunk holds at the nominal 4
        # characters per token, so the index's capacity (in chunks) means the same for both
        self._chunk_ids = max(1, chunk_chars // _NOMINAL_CHARS_PER_TOKEN)
        self.index = PrefixIndex(max_blocks_per_replica)
        self.max_sessions = max_sessions
        self._token_ids = token_ids  # text -> token ids (precise mode)
        self._model = model  # the model name the engine hashes with, when the body names none
        # precise mode: a guard.request.chat_template.ChatTemplate (None: chat priced uncached)
        self._chat_template = chat_template
        self.num_unrendered_chats = 0  # chat requests the template could not render
        self._block_sizes: dict[str, int] = {}
        self._sessions: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._counts: dict[str, _Counts] = {}
        # replica id -> [predicted cached tokens, routed prompt tokens] over the view's life
        # (never reset, unlike the ratio's tallies: exported as counters)
        self.totals: dict[str, list[int]] = {}
        # precise mode: called with (replica id, endpoint) when a replica advertises where its
        # KV-cache events are published (``kv_events_endpoint`` in its state document)
        self.on_events_endpoint: Callable[[str, str], None] | None = None
        # precise mode: called with the replica id for each kvguard state document (the
        # replica is a kvguard engine: its events carry kvguard's own hashes), and by forget
        self.on_kvguard_state: Callable[[str], None] | None = None
        self.on_forget: Callable[[str], None] | None = None
        # replica id -> the model it serves, as its state or metrics name it (the root of the
        # chains translated from its events)
        self.replica_models: dict[str, str] = {}

    # --- a request ---------------------------------------------------------------------------

    def key(self, body: Mapping, is_chat: bool, num_prompt_tokens: int, chars_per_token: float,
            cache_salt: str | None, session_id: str | None = None,
            chat_ids: object = _RENDER) -> PrefixKey:
        """The request's prefix key (priced bodies only: the pricer validated them).
        ``chat_ids``: a chat request's ids as :meth:`chat_token_ids` gave them (None: it
        cannot be rendered), when the caller has them already; rendered here otherwise."""
        model = body.get("model") if isinstance(body.get("model"), str) else self._model
        if self.mode == "precise":
            block_size = self._block_size()
            if is_chat:  # the prompt the replicas' template renders (not the view's own)
                ids = self.chat_token_ids(body) if chat_ids is _RENDER else chat_ids
            else:
                prompt = render_prompt(body, False)
                ids = prompt if isinstance(prompt, list) else self._token_ids(prompt)
            hashes: tuple[int, ...] = () if ids is None else token_block_hashes(
                ids, block_size, model, cache_salt)  # () : priced as uncached
            return PrefixKey(hashes, float(block_size), num_prompt_tokens, session_id)
        prompt = render_prompt(body, is_chat)
        if isinstance(prompt, list):  # chunks of as many ids as a text chunk holds tokens
            chunk_ids = self._chunk_ids
            hashes = id_chunk_hashes(prompt, chunk_ids, model, cache_salt)
            return PrefixKey(hashes, float(chunk_ids), num_prompt_tokens, session_id)
        hashes = text_chunk_hashes(prompt, self.chunk_chars, model, cache_salt)
        return PrefixKey(hashes, self.chunk_chars / chars_per_token, num_prompt_tokens, session_id)

    def chat_token_ids(self, body: Mapping) -> list[int] | None:
        """A chat request's prompt ids as the replicas' template renders it (precise mode;
        None: no template, or one that cannot render this request: counted, the first one
        logged). The pricer counts the prompt with them too."""
        if self._chat_template is None:
            return None
        text, why = self._chat_template.render(body)
        if text is None:
            self.num_unrendered_chats += 1
            if self.num_unrendered_chats == 1:
                log.warning("a chat request the chat template cannot render is priced as "
                            "uncached (%s); later ones are only counted "
                            "(kvguard_prefix_cache_unrendered_chats_total)", why)
            return None
        return self._token_ids(text)

    def cached_tokens(self, key: PrefixKey) -> dict[str, int] | None:
        """Replica id -> prompt tokens its cache is expected to hold for ``key`` (only the
        replicas that hold some); None when none does."""
        out = None
        index = self.index
        for replica_id in index.replica_ids():
            matched = index.num_matched(replica_id, key.hashes)
            if matched:
                if out is None:
                    out = {}
                out[replica_id] = int(matched * key.tokens_per_hash)
        if key.session_id is not None:
            last = self._sessions.get(key.session_id)
            if last is not None:
                replica_id, num_tokens = last
                if out is None:
                    out = {}
                out[replica_id] = max(out.get(replica_id, 0), num_tokens)
        return out

    def routed(self, replica_id: str, cost: RequestCost) -> None:
        """``cost`` was admitted to ``replica_id``: tally its predicted hit; in approximate
        mode the replica now holds its prefix; its session goes there."""
        key = cost.prefix_key
        if not isinstance(key, PrefixKey):
            return
        counts = self._counts_of(replica_id)
        num_cached = cost.num_cached_tokens_on(replica_id, self._block_sizes.get(replica_id, 1))
        counts.num_routed_prompt_tokens += cost.num_prompt_tokens
        counts.num_predicted_cached_tokens += num_cached
        totals = self.totals.setdefault(replica_id, [0, 0])
        totals[0] += num_cached
        totals[1] += cost.num_prompt_tokens
        if self.mode == "approximate":
            self.index.insert(replica_id, key.hashes)
        if key.session_id is not None:
            sessions = self._sessions
            sessions[key.session_id] = (replica_id, cost.num_prompt_tokens)
            sessions.move_to_end(key.session_id)
            if len(sessions) > self.max_sessions:
                sessions.popitem(last=False)

    # --- what the replicas say ---------------------------------------------------------------

    def replica_state(self, replica_id: str, state: Mapping) -> None:
        """A ``/kvguard/state`` document: capacity, block size, restart, measured hits."""
        model = state.get("model")
        if isinstance(model, str) and model:  # what the engine hashes with, when bodies omit it
            self._model = model
            self.replica_models[replica_id] = model
        if self.on_kvguard_state is not None:
            self.on_kvguard_state(replica_id)
        total, block_size = state.get("num_total_blocks"), state.get("block_size")
        if _count(block_size) and block_size > 0:
            self._block_sizes[replica_id] = block_size
        if _count(total):
            self._set_capacity(replica_id, total)
        counts = self._counts_of(replica_id)
        step_count = state.get("step_count")
        if _count(step_count):
            if counts.step_count is not None and step_count < counts.step_count:
                self.forget(replica_id)  # the engine started over: its cache is empty
                counts = self._counts_of(replica_id)
            counts.step_count = step_count
        self._measured(replica_id, state.get("prefix_cache_queries"),
                       state.get("prefix_cache_hits"))
        endpoint = state.get("kv_events_endpoint")
        if isinstance(endpoint, str) and endpoint and self.on_events_endpoint is not None:
            self.on_events_endpoint(replica_id, endpoint)

    def replica_metrics(self, replica_id: str, metrics: Mapping[str, float],
                        model: str | None = None) -> None:
        """A vLLM ``/metrics`` scrape (``guard.replicas.vllm_metrics.parse_vllm_metrics``), and
        the model its metrics are labelled with (``served_model_name``)."""
        if model:
            self.replica_models[replica_id] = model
        block_size = metrics.get("block_size")
        if block_size:
            self._block_sizes[replica_id] = int(block_size)
        if metrics.get("num_gpu_blocks"):
            self._set_capacity(replica_id, int(metrics["num_gpu_blocks"]))
        self._measured(replica_id, metrics.get("prefix_cache_queries"),
                       metrics.get("prefix_cache_hits"))

    def replica_down(self, replica_id: str) -> None:
        """The poller lost the replica: whatever comes back may have restarted cold."""
        self.forget(replica_id)

    def forget(self, replica_id: str) -> None:
        """Empty the replica's view and start its tallies over (its sessions lose their pin:
        their entries point at a cache that no longer exists, and are dropped lazily)."""
        self.index.clear(replica_id)
        if self.on_forget is not None:
            self.on_forget(replica_id)
        self._counts.pop(replica_id, None)
        for session_id in [s for s, (r, _) in self._sessions.items() if r == replica_id]:
            del self._sessions[session_id]

    # --- reading ------------------------------------------------------------------------------

    def predicted_hit_ratio(self, replica_id: str) -> float | None:
        counts = self._counts.get(replica_id)
        if counts is None or not counts.num_routed_prompt_tokens:
            return None
        return counts.num_predicted_cached_tokens / counts.num_routed_prompt_tokens

    def measured_hit_ratio(self, replica_id: str) -> float | None:
        """The engine's hits ÷ queries since this view started counting (or since the
        replica restarted)."""
        counts = self._counts.get(replica_id)
        if counts is None or counts.queries is None or counts.base_queries is None:
            return None
        queries = counts.queries - counts.base_queries
        if queries <= 0:
            return None
        return (counts.hits - counts.base_hits) / queries

    def replica_ids(self) -> tuple[str, ...]:
        return tuple(self._counts)

    # --- internals ----------------------------------------------------------------------------

    def _block_size(self) -> int:
        sizes = set(self._block_sizes.values())
        return sizes.pop() if len(sizes) == 1 else _TOKEN_BLOCK

    def _set_capacity(self, replica_id: str, num_blocks: int) -> None:
        if self.mode == "approximate":  # a chunk holds about chunk_ids tokens, not a block
            block_size = self._block_sizes.get(replica_id, _TOKEN_BLOCK)
            num_blocks = max(1, math.ceil(num_blocks * block_size / self._chunk_ids))
        self.index.set_capacity(replica_id, num_blocks)

    def _counts_of(self, replica_id: str) -> _Counts:
        counts = self._counts.get(replica_id)
        if counts is None:
            counts = self._counts[replica_id] = _Counts()
        return counts

    def _measured(self, replica_id: str, queries: object, hits: object) -> None:
        if not (_number(queries) and _number(hits)):
            return
        counts = self._counts_of(replica_id)
        if counts.queries is not None and queries < counts.queries:
            self.forget(replica_id)  # a counter went backwards: the engine restarted
            counts = self._counts_of(replica_id)
        if counts.base_queries is None:
            counts.base_queries, counts.base_hits = queries, hits
        counts.queries, counts.hits = queries, hits


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def build_prefix_view(config: object, token_ids: Callable[[str], list[int]] | None = None
                      ) -> PrefixCacheView | None:
    """The view a :class:`~guard.config.GuardConfig` asks for (None when ``prefix_cache`` is
    ``"off"``); ``token_ids``: the tokenizer's ids (precise mode)."""
    if config.prefix_cache == "off":
        return None
    return PrefixCacheView(config.prefix_cache, chunk_chars=config.prefix_cache_chunk_chars,
                           max_blocks_per_replica=config.prefix_cache_max_blocks,
                           max_sessions=config.prefix_cache_max_sessions, token_ids=token_ids,
                           chat_template=config.loaded_chat_template)
