import asyncio

from guard.admission.queue import QUEUE_FULL, QUEUE_TIMEOUT, AdmissionQueue
from policies.decision import Queue, Shed
from tests.support.admission import BATCH, INTERACTIVE, FakeClock, make_cost


def run(coro):
    return asyncio.run(coro)


def test_order_is_priority_then_deadline_and_pump_admits_in_order():
    async def main():
        q = AdmissionQueue(8, FakeClock())
        late = q.push(make_cost("late", deadline_s=5.0), until_s=9.0, now_s=0.0)
        batch = q.push(make_cost("batch", klass=BATCH, deadline_s=1.0), until_s=9.0, now_s=0.0)
        early = q.push(make_cost("early", deadline_s=2.0), until_s=9.0, now_s=0.0)
        assert [w.cost.request_id for w in q.waiters()] == ["early", "late", "batch"]
        seen = []

        def decide(cost, now_s, ahead):  # room for exactly one: the first asked is admitted
            seen.append((cost.request_id, ahead.num_requests, ahead.num_prefill_tokens))
            return "ticket" if len(seen) == 1 else Queue(until_s=9.0)

        assert q.pump(decide, 1.0) == 1
        # each is decided behind the waiters still queued before it (the admitted one is not)
        assert seen == [("early", 0, 0), ("late", 0, 0), ("batch", 1, 10)]
        assert early.future.result() == "ticket"
        assert not late.future.done() and not batch.future.done() and len(q) == 2
    run(main())


def test_deadline_evicts_with_queue_timeout_without_asking_the_policy():
    async def main():
        q = AdmissionQueue(8, FakeClock())
        w = q.push(make_cost("a"), until_s=2.0, now_s=0.0)
        asked = []
        q.pump(lambda c, t, ahead: asked.append(c) or Queue(until_s=2.0), 1.0)
        assert not w.future.done() and len(asked) == 1
        q.pump(lambda c, t, ahead: asked.append(c) or "ticket", 2.0)
        assert w.future.result() == Shed(503, QUEUE_TIMEOUT) and len(asked) == 1 and len(q) == 0
    run(main())


def test_policy_shed_resolves_waiter():
    async def main():
        q = AdmissionQueue(8, FakeClock())
        w = q.push(make_cost("a"), until_s=5.0, now_s=0.0)
        q.pump(lambda c, t, ahead: Shed(503, "overloaded"), 0.5)
        assert w.future.result() == Shed(503, "overloaded") and len(q) == 0
    run(main())


def test_full_queue_sheds_worst_entry_or_newcomer():
    async def main():
        q = AdmissionQueue(2, FakeClock())
        a = q.push(make_cost("a", deadline_s=1.0), 9.0, 0.0)
        b = q.push(make_cost("b", klass=BATCH, deadline_s=1.0), 9.0, 0.0)
        # newcomer better than the batch entry: the batch entry is shed
        c = q.push(make_cost("c", deadline_s=3.0), 9.0, 0.0)
        assert b.future.result() == Shed(503, QUEUE_FULL)
        assert [w.cost.request_id for w in q.waiters()] == ["a", "c"]
        # newcomer worse than everyone: the newcomer is shed, the queue is unchanged
        d = q.push(make_cost("d", deadline_s=7.0), 9.0, 0.0)
        assert d == Shed(503, QUEUE_FULL)
        assert not a.future.done() and not c.future.done() and len(q) == 2
    run(main())


def test_zero_length_queue_sheds_everyone():
    async def main():
        q = AdmissionQueue(0, FakeClock())
        assert q.push(make_cost(), 9.0, 0.0) == Shed(503, QUEUE_FULL)
    run(main())


def test_remove_and_canceled_futures_leave_the_queue():
    async def main():
        q = AdmissionQueue(4, FakeClock())
        a = q.push(make_cost("a"), 9.0, 0.0)
        b = q.push(make_cost("b", deadline_s=2.0), 9.0, 0.0)
        assert q.remove(a) is True and q.remove(a) is False
        b.future.cancel()
        asked = []
        assert q.pump(lambda c, t, ahead: asked.append(c), 0.1) == 1
        assert asked == [] and len(q) == 0
    run(main())


def test_run_pumps_on_wake_and_on_interval():
    async def main():
        clock = FakeClock()
        q = AdmissionQueue(4, clock, interval_s=0.005)
        room = {"free": False}

        def decide(cost, now_s, ahead):
            return "ticket" if room["free"] else Queue(until_s=99.0)

        task = asyncio.ensure_future(q.run(decide))
        await asyncio.sleep(0)
        w = q.push(make_cost("a", klass=INTERACTIVE), 99.0, 0.0)
        await asyncio.sleep(0.02)
        assert not w.future.done()
        room["free"] = True
        q.wake()
        assert await asyncio.wait_for(w.future, 1.0) == "ticket"
        task.cancel()
    run(main())


def test_a_newcomer_waits_behind_its_priority_and_the_more_important_ones():
    async def main():
        q = AdmissionQueue(8, FakeClock())
        assert q.ahead_of(make_cost("new")).num_requests == 0
        a = q.push(make_cost("a", num_blocks=7), 9.0, 0.0)
        q.push(make_cost("b", klass=BATCH, num_blocks=4), 9.0, 0.0)
        ahead = q.ahead_of(make_cost("new"))  # make_cost prompts are 10 tokens
        assert (ahead.num_requests, ahead.num_prefill_tokens, ahead.num_blocks) == (1, 10, 7)
        assert q.ahead_of(make_cost("new", klass=BATCH)).num_requests == 2
        q.push(make_cost("retry", is_retry=True), 9.0, 0.0)  # behind first attempts
        assert q.ahead_of(make_cost("new")).num_requests == 1
        assert q.ahead_of(make_cost("new", is_retry=True)).num_requests == 2
        q.remove(q.waiters()[1])
        q.remove(a)
        assert q.ahead_of(make_cost("new")).num_requests == 0
        q.pump(lambda c, t, ahead: Shed(503, "overloaded"), 0.5)  # b leaves the queue
        assert q.ahead_of(make_cost("new", klass=BATCH)).num_requests == 0
    run(main())


def test_a_full_queue_sheds_retries_before_first_attempts_of_the_same_class():
    async def main():
        q = AdmissionQueue(2, FakeClock())
        retry = q.push(make_cost("retry", deadline_s=1.0, is_retry=True), 9.0, 0.0)
        first = q.push(make_cost("first", deadline_s=5.0), 9.0, 0.0)
        assert [w.cost.request_id for w in q.waiters()] == ["first", "retry"]
        q.push(make_cost("late-first", deadline_s=7.0), 9.0, 0.0)
        assert retry.future.result() == Shed(503, QUEUE_FULL) and not first.future.done()
        assert q.push(make_cost("r2", deadline_s=0.5, is_retry=True), 9.0, 0.0) == \
            Shed(503, QUEUE_FULL)
    run(main())


def test_a_waiter_whose_prefix_is_cached_counts_only_its_uncached_part_ahead():
    """A queued request goes where its prefix is cached: the requests behind it wait for its
    uncached prompt and new blocks there, not its whole prompt (2,000 of 2,100 tokens cached
    on r2: 100 tokens and 11 of its 136 blocks — 125 of them hold 2,000 of its 2,164)."""
    import dataclasses

    async def main():
        q = AdmissionQueue(8, FakeClock())
        warm = dataclasses.replace(make_cost("warm", num_blocks=136), num_prompt_tokens=2100,
                                   max_tokens=64, cached_prefix_tokens={"r1": 1000, "r2": 2000})
        q.push(warm, 9.0, 0.0)
        ahead = q.ahead_of(make_cost("new"))
        assert (ahead.num_requests, ahead.num_prefill_tokens, ahead.num_blocks) == (1, 100, 11)
        seen = []
        q.pump(lambda c, t, behind: seen.append(behind) or None, 0.5)  # both stay queued
        q.push(make_cost("next"), 9.0, 0.0)
        q.pump(lambda c, t, behind: seen.append(behind) or None, 0.6)
        assert (seen[-1].num_prefill_tokens, seen[-1].num_blocks) == (100, 11)
        cold = dataclasses.replace(warm, request_id="cold", cached_prefix_tokens={})
        q.push(cold, 9.0, 0.0)
        assert q.ahead_of(make_cost("new")).num_prefill_tokens == 100 + 10 + 2100
    run(main())


def test_a_waiter_counts_ahead_only_on_the_replicas_holding_the_most_of_its_prefix():
    """The warm waiter (2,000 tokens cached on r2, 1,000 on r1) will go to r2: a request
    forecast on r1 or r3 does not wait for it there; a waiter no replica holds counts on every
    replica. The pump tells each waiter the same about the ones before it."""
    import dataclasses

    async def main():
        q = AdmissionQueue(8, FakeClock())
        warm = dataclasses.replace(make_cost("warm", num_blocks=136), num_prompt_tokens=2100,
                                   max_tokens=64, cached_prefix_tokens={"r1": 1000, "r2": 2000})
        q.push(warm, 9.0, 0.0)
        q.push(make_cost("cold"), 9.0, 0.0)  # a 10-token prompt, 2 blocks, cached nowhere
        ahead = q.ahead_of(make_cost("new"))
        assert (ahead.num_requests, ahead.num_prefill_tokens, ahead.num_blocks) == (2, 110, 13)
        assert ahead.on("r2") == (2, 110, 13)
        assert ahead.on("r1") == ahead.on("r3") == (1, 10, 2)
        seen = []
        q.push(make_cost("last", deadline_s=50.0), 9.0, 0.0)
        q.pump(lambda c, t, behind: seen.append((c.request_id, behind)) or None, 0.5)
        last = dict(seen)["last"]
        assert (last.on("r1"), last.on("r2")) == ((1, 10, 2), (2, 110, 13))
        q.pump(lambda c, t, behind: Shed(503, "gone") if c.request_id == "warm" else None, 0.6)
        assert q.ahead_of(make_cost("new")).on("r2") == (2, 20, 4)  # cold and last, anywhere
    run(main())
