from policy_builders import decoding, make_replica, prompt_waiting

from policies.snapshot import SeqLoad


def test_group_sums_and_committed_blocks():
    # Running: 32 ctx + 16 to go = 3 blocks final, 2 held -> 1 committed (itl 0.05).
    # Waiting: 100 prompt + 10 output = 7 blocks, none held -> 7 committed.
    # Reserved: covered by num_reserved_blocks, so not committed again.
    reserved = SeqLoad(0, 20, 4, itl_s=0.03)
    replica = make_replica(
        running=[decoding(itl_s=0.05)],
        waiting=[prompt_waiting(100, 10)],
        reserved=[reserved],
        reserved_blocks=2,
    )
    load = replica.load
    assert (load.num_seqs, load.num_decode_seqs, load.num_running_context_tokens) == (3, 1, 32)
    assert (load.num_context_tokens, load.num_queued_prefill_tokens) == (32 + 100 + 20, 120)
    assert load.num_committed_blocks == 1 + 7
    assert load.min_itl_s == 0.03
    # Finish: reserved 1 chunk + 4 = 5 steps (2 blocks), waiting 2 chunks + 10 = 12 (7 blocks),
    # running 16 steps (3 blocks).
    assert load.finish_schedule.num_steps == (5, 12, 16)
    assert load.finish_schedule.num_freed_blocks == (2, 9, 12)


def test_empty_replica():
    load = make_replica().load
    assert (load.num_seqs, load.num_committed_blocks, load.min_itl_s) == (0, 0, None)
    assert load.finish_schedule.num_steps == ()


def test_with_reservations_keeps_the_engine_sums_and_recounts_the_reservations():
    base = make_replica(running=[decoding()], inflight=1)
    running_totals = base.load.running
    new = base.with_reservations((SeqLoad(0, 40, 8),), num_reserved_blocks=3, num_inflight=2)
    assert new.load.running is running_totals
    assert (new.num_reserved_blocks, new.num_inflight, new.num_available_blocks) == (3, 2, 47)
    assert (new.load.num_seqs, new.load.num_queued_prefill_tokens) == (2, 40)
    assert new == make_replica(
        running=[decoding()], inflight=2, reserved=[SeqLoad(0, 40, 8)], reserved_blocks=3
    )
    assert base.load.num_seqs == 1
