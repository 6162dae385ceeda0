"""PrefixCacheView: keys, where a prefix went, restarts that empty a replica's view, sessions,
and predicted beside measured hit ratios; wired through LoadState."""

import dataclasses

from guard.replicas.load_state import LoadState
from guard.replicas.prefix_cache import PrefixCacheView, render_prompt
from policies.cost import RequestClass, RequestCost
from tests.support.admission import state_doc

SYSTEM = "You are a careful assistant. " * 80  # 2,320 characters: 9 chunks of 256
CLASS = RequestClass("interactive", 1.0, 0.08)


def chat(question: str, system: str = SYSTEM) -> dict:
    return {"model": "tiny", "messages": [{"role": "system", "content": system},
                                          {"role": "user", "content": question}]}


def cost_for(view, body, num_prompt_tokens=600, session_id=None, salt=None, request_id="r"):
    key = view.key(body, "messages" in body, num_prompt_tokens, 4.0, salt, session_id)
    return RequestCost(request_id, "acme", CLASS, num_prompt_tokens, 64, 32,
                       -(-(num_prompt_tokens + 64) // 16), 0.0, 1.0,
                       cached_prefix_tokens=view.cached_tokens(key), prefix_key=key)


def test_a_prefix_routed_to_a_replica_is_expected_cached_there_only():
    view = PrefixCacheView()
    first = cost_for(view, chat("What is a KV cache?"))
    assert first.cached_prefix_tokens is None
    view.routed("a", first)
    second = cost_for(view, chat("And a block table?"))
    # the system prompt's 9 full chunks of 256 characters, 64 tokens each at 4 chars/token
    assert second.cached_prefix_tokens == {"a": 9 * 64}
    assert cost_for(view, chat("Hi", system="Another system prompt " * 80)
                    ).cached_prefix_tokens is None
    # a different salt (another tenant, isolated) shares nothing
    assert cost_for(view, chat("And a block table?"), salt="t2").cached_prefix_tokens is None


def test_render_prompt_keeps_the_conversation_order():
    body = chat("q")
    longer = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "a"},
                                   {"role": "user", "content": "q2"}]}
    assert render_prompt(longer, True).startswith(render_prompt(body, True))
    assert render_prompt({"prompt": [[1, 2, 3]]}, False) == [1, 2, 3]


def test_a_restart_empties_the_replicas_view():
    view = PrefixCacheView()
    view.replica_state("a", {**state_doc(), "step_count": 500})
    view.routed("a", cost_for(view, chat("q")))
    view.routed("b", cost_for(view, chat("q")))
    view.replica_state("a", {**state_doc(), "step_count": 600})
    assert view.index.num_blocks("a") == 9
    view.replica_state("a", {**state_doc(), "step_count": 3})  # started over
    assert view.index.num_blocks("a") == 0
    assert view.index.num_blocks("b") == 9
    # the prefix-cache counters going backwards say the same
    view.routed("a", cost_for(view, chat("q")))
    view.replica_state("a", {**state_doc(), "step_count": 10, "prefix_cache_queries": 900,
                             "prefix_cache_hits": 500})
    view.replica_state("a", {**state_doc(), "step_count": 11, "prefix_cache_queries": 40,
                             "prefix_cache_hits": 0})
    assert view.index.num_blocks("a") == 0


def test_load_state_tells_the_view_of_states_losses_and_admissions():
    load_state = LoadState()
    view = load_state.cache_view = PrefixCacheView()
    load_state.update_from_kvguard_state("a", state_doc(), 0.0)
    cost = cost_for(view, chat("q"))
    load_state.admitted("a", cost)
    assert view.index.num_blocks("a") == 9
    load_state.mark_unhealthy("a", 1.0)  # down: it may come back cold
    assert view.index.num_blocks("a") == 0


def test_a_reservation_counts_only_the_blocks_and_prefill_a_cached_prefix_leaves():
    load_state = LoadState()
    load_state.update_from_kvguard_state("a", state_doc(max_model_len=4096), 0.0)
    load_state.update_from_kvguard_state("b", state_doc(max_model_len=4096), 0.0)
    cost = dataclasses.replace(cost_for(PrefixCacheView(), chat("q")),
                               cached_prefix_tokens={"a": 500})
    load_state.reserve("a", "r1", cost, 0.0)
    load_state.reserve("b", "r2", dataclasses.replace(cost, request_id="r2"), 0.0)
    a, b = load_state.replica_snapshot("a"), load_state.replica_snapshot("b")
    assert b.num_reserved_blocks == cost.num_blocks == 42
    assert a.num_reserved_blocks == 42 - 31  # 496 cached tokens: 31 blocks of 16
    assert a.reserved[0].num_prefill_tokens_remaining == 600 - 496
    load_state.move("r1", "b", 1.0)  # redispatched where nothing is cached
    assert load_state.replica_snapshot("b").num_reserved_blocks == 2 * 42


def test_a_session_prefers_where_it_went_last():
    view = PrefixCacheView()
    turn = cost_for(view, chat("short", system="s"), num_prompt_tokens=40, session_id="s1")
    view.routed("b", turn)
    nxt = cost_for(view, chat("short", system="s"), num_prompt_tokens=80, session_id="s1")
    assert nxt.cached_prefix_tokens == {"b": 40}
    view.forget("b")
    assert cost_for(view, chat("x", system="s"), session_id="s1").cached_prefix_tokens is None


def test_predicted_hit_ratio_beside_the_engines_measured_one():
    view = PrefixCacheView()
    view.replica_state("a", {**state_doc(), "prefix_cache_queries": 1000,
                             "prefix_cache_hits": 100})
    view.routed("a", cost_for(view, chat("q")))  # cold: predicted 0 of 600
    view.routed("a", cost_for(view, chat("q2")))  # 576 of 600 (whole blocks of 16)
    assert view.predicted_hit_ratio("a") == 576 / 1200
    view.replica_state("a", {**state_doc(), "prefix_cache_queries": 2200,
                             "prefix_cache_hits": 700})
    assert view.measured_hit_ratio("a") == 600 / 1200
    assert view.predicted_hit_ratio("z") is None and view.measured_hit_ratio("z") is None


def test_the_approximate_views_capacity_is_the_replicas_tokens_in_chunks():
    view = PrefixCacheView()  # 256-character chunks: 64 tokens each, text or token ids
    view.replica_state("a", {**state_doc(num_free_blocks=2000)})
    assert view.index.capacity("a") == 2000 * 16 // 64
    key = view.key({"model": "m", "prompt": list(range(2000))}, False, 2000, 4.0, None)
    assert len(key.hashes) == 31 and key.tokens_per_hash == 64.0
