"""The poller applies pushed (streamed) updates in batches: every update that came before the
loop's next turn (a round of stream reads brings ~13 at once), in arrival order, each stamped
with its arrival time; a round applies the open batch first; a replica that left has its
waiting update dropped."""

from __future__ import annotations

import asyncio

from chaos.bench.scale import fleet_document
from engine.compact_state import compact_state
from guard.replicas.load_state import LoadState
from guard.replicas.poller import StatePoller
from guard.replicas.state_stream import UNCHANGED


class _Pushing:
    """A source that pushes (as a stream does): ``push(payload)`` hands it to the poller."""

    kind = "kvguard"
    answers_now = True

    def __init__(self) -> None:
        self.listener = None

    def listen(self, listener) -> None:  # noqa: ANN001 - the poller's callable
        self.listener = listener

    def push(self, payload) -> None:  # noqa: ANN001 - a document or UNCHANGED
        self.listener(payload)

    async def fetch(self):  # noqa: ANN201 - a live stream's round finds nothing new
        return None


class _Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _poller(num: int, interval_s: float = 0.1, **kwargs):  # noqa: ANN202
    sources = {f"r{k}": _Pushing() for k in range(num)}
    clock, load = _Clock(), LoadState()
    return StatePoller(load, sources, interval_s, clock=clock, **kwargs), sources, load, clock


def test_updates_that_come_together_are_applied_together_each_as_of_its_arrival():
    async def main():
        poller, sources, load, clock = _poller(8)
        applied = []
        update = load.update_from_kvguard_state
        load.update_from_kvguard_state = lambda rid, doc, now_s: (
            applied.append((rid, now_s)), update(rid, doc, now_s))[1]
        for k in (3, 0, 5, 1):
            clock.now_s += 1.0
            sources[f"r{k}"].push(compact_state(fleet_document(k, 4)))
        assert applied == [] and load.replica_snapshot("r3") is None  # waiting for the batch
        await asyncio.sleep(0)  # the loop's next turn
        assert applied == [("r3", 101.0), ("r0", 102.0), ("r5", 103.0), ("r1", 104.0)]
        assert load.replica_snapshot("r5").observed_s == 103.0
        assert poller.num_push_batches == 1
        clock.now_s = 105.0
        sources["r1"].push(UNCHANGED)  # a heartbeat: only the view's stamp moves
        clock.now_s = 200.0
        await asyncio.sleep(0)
        assert load.replica_snapshot("r1").observed_s == 105.0  # as of its arrival
        assert poller.num_push_batches == 2

    asyncio.run(main())


def test_a_round_applies_the_open_batch_first():
    async def main():
        seen = []
        poller, sources, load, _ = _poller(2, interval_s=60.0)
        poller._on_refresh = lambda: seen.append(load.replica_snapshot("r0"))
        sources["r0"].push(compact_state(fleet_document(0, 4)))
        await poller.refresh_now()  # at once: the loop has not turned
        assert seen and seen[0] is not None and poller.num_push_batches == 1

    asyncio.run(main())


def test_a_replica_that_left_has_its_waiting_update_dropped():
    async def main():
        poller, sources, load, _ = _poller(2)
        sources["r0"].push(compact_state(fleet_document(0, 4)))
        sources["r1"].push(compact_state(fleet_document(1, 4)))
        poller.remove("r0")
        await asyncio.sleep(0)
        assert load.replica_snapshot("r0") is None and load.replica_snapshot("r1") is not None

    asyncio.run(main())


def test_stop_applies_what_came_before_it():
    async def main():
        poller, sources, load, _ = _poller(1, interval_s=60.0)
        sources["r0"].push(compact_state(fleet_document(0, 4)))
        await poller.stop()
        assert load.replica_snapshot("r0") is not None

    asyncio.run(main())
