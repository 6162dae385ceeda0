"""Workloads: shared prefixes with Zipf popularity, multi-turn conversations that resend
themselves; prompts are seeded and share exactly the parts they name."""

import collections

import pytest

from chaos.schedule import LengthDist, ScheduleConfig, build_schedule, prompt_token_ids
from chaos.workloads import MultiTurn, SharedPrefix, make_workload


def schedule(workload, n_s=40.0, rate=5.0, prompt="50:150"):
    cfg = ScheduleConfig(rate_per_s=rate, duration_s=n_s, seed=3,
                         prompt_tokens=LengthDist.parse(prompt), workload=workload)
    return build_schedule(cfg)


def test_shared_prefix_requests_share_exactly_their_prefix():
    specs = schedule(SharedPrefix(num_prefixes=4, prefix_tokens=300, zipf_s=1.0))
    by_prefix = collections.defaultdict(list)
    for s in specs:
        assert s.num_prompt_tokens == 300 + s.prompt_parts[1][1]
        assert 50 <= s.prompt_parts[1][1] <= 150
        by_prefix[s.prompt_parts[0][0]].append(s)
    counts = sorted((len(v) for v in by_prefix.values()), reverse=True)
    assert len(counts) == 4 and counts[0] > 2 * counts[-1]  # Zipf: the hottest dominates
    a, b = by_prefix["prefix-0"][:2]
    ids_a, ids_b = prompt_token_ids(3, a), prompt_token_ids(3, b)
    assert len(ids_a) == a.num_prompt_tokens and ids_a[:300] == ids_b[:300]
    assert ids_a[300:310] != ids_b[300:310]
    other = by_prefix["prefix-1"][0]
    assert prompt_token_ids(3, other)[:300] != ids_a[:300]
    assert schedule(SharedPrefix(4, 300)) == specs  # seeded


def test_multi_turn_resends_the_conversation_so_far():
    specs = schedule(MultiTurn(num_sessions=3, system_tokens=100, max_turns=4,
                               max_prompt_tokens=5000))
    turns = collections.defaultdict(list)
    for s in specs:
        turns[s.session_id].append(s)
    conversation = max(turns.values(), key=len)
    assert 2 <= len(conversation) <= 4
    first, second = conversation[:2]
    ids1, ids2 = prompt_token_ids(3, first), prompt_token_ids(3, second)
    assert ids2[:len(ids1)] == ids1  # the whole earlier prompt leads the next turn
    # then the earlier answer (the length it asked for) and the new question
    assert second.num_prompt_tokens == first.num_prompt_tokens + first.max_tokens + \
        second.prompt_parts[-1][1]
    assert all(len(v) <= 4 for v in turns.values())


def test_a_conversation_past_its_prompt_bound_starts_over():
    specs = schedule(MultiTurn(num_sessions=1, system_tokens=100, max_turns=50,
                               max_prompt_tokens=600), n_s=10.0)
    assert all(s.num_prompt_tokens <= 600 for s in specs)
    assert len({s.session_id for s in specs}) > 1


def test_bad_values_are_refused_by_name():
    with pytest.raises(ValueError, match="num_prefixes"):
        SharedPrefix(num_prefixes=0)
    with pytest.raises(ValueError, match="zipf_s"):
        SharedPrefix(zipf_s=-1.0)
    with pytest.raises(ValueError, match="num_sessions"):
        MultiTurn(num_sessions=0)
    with pytest.raises(ValueError, match="workload"):
        make_workload("cached")
    assert make_workload("unique") is None
