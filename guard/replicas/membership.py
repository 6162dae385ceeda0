"""``FleetMembership``: the replicas a running front end (the proxy, the EPP) serves, changed
while it runs (``replicas_from``, :mod:`guard.replicas.discovery`).

:meth:`FleetMembership.apply` takes the fleet's new list. A new id **joins**: its health
record, weight, shared reservations and state source are set up, so it is polled from the next
round and routable once its state is read. A missing id **leaves**: no longer polled, unhealthy
in the load state at once (no policy picks it), its requests in flight run on; once it holds
no reservation :meth:`forget_drained` drops its load state, reservations, prefix view, learned
limit and health record. A list that would change an id that stays (its URL, key, …) or bring
back one still draining is refused whole (ValueError) and changes nothing. What only the
front end holds (the proxy's forwarder, model lists and series; the EPP's endpoints) follows
through ``on_join`` / ``on_leave`` / ``on_forget``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from guard.config import ReplicaConfig
from guard.redact import redact_url

__all__ = ["FleetMembership", "start_fleet", "stop_fleet"]

log = logging.getLogger(__name__)

_COMPARED = ("url", "state_source", "max_model_len", "weight", "kv_events_endpoint", "models",
             "api_key")


class FleetMembership:
    """``make_source(replica)``: its state source (ungated); ``health``: the front end's
    :class:`guard.proxy.health.ReplicaHealth`; ``shared``: its shared reservations, if any."""

    def __init__(self, replicas: tuple[ReplicaConfig, ...], controller: Any, health: Any,
                 make_source: Callable[[ReplicaConfig], Any], shared: Any = None, *,
                 on_join: Callable[[ReplicaConfig], None] | None = None,
                 on_leave: Callable[[str], None] | None = None,
                 on_forget: Callable[[str], None] | None = None) -> None:
        self.replicas = {r.replica_id: r for r in replicas}  # the fleet now
        self.leaving: dict[str, ReplicaConfig] = {}  # left the list, still draining
        self._controller = controller
        self._health = health
        self._make_source = make_source
        self._shared = shared
        self._on_join, self._on_leave, self._on_forget = on_join, on_leave, on_forget

    def apply(self, replicas: tuple[ReplicaConfig, ...]) -> None:
        """The fleet is now ``replicas`` (see the module docstring)."""
        new = {r.replica_id: r for r in replicas}
        for rid, replica in new.items():
            old = self.replicas.get(rid)
            if old is not None and old != replica:
                changed = ", ".join(f for f in _COMPARED
                                    if getattr(old, f) != getattr(replica, f))
                raise ValueError(f"replica {rid!r} changed ({changed}): a changed replica "
                                 "needs a new replica_id")
            if old is None and rid in self.leaving:
                raise ValueError(f"replica {rid!r} is still draining: it can come back once "
                                 "its requests finished")
        for rid in [rid for rid in self.replicas if rid not in new]:
            self._leave(rid)
        for rid, replica in new.items():
            if rid not in self.replicas:
                self._join(replica)

    def _join(self, replica: ReplicaConfig) -> None:
        rid = replica.replica_id
        self.replicas[rid] = replica
        self._health.add(rid)
        self._controller.load_state.set_weight(rid, replica.weight)
        if self._shared is not None:
            self._shared.add_replica(rid, replica.url)
        if self._on_join is not None:
            self._on_join(replica)
        source = self._make_source(replica)
        self._controller.add_source(rid, self._health.gate(rid, source))
        log.info("replica %s joined the fleet (%s)", rid, redact_url(replica.url))

    def _leave(self, rid: str) -> None:
        self.leaving[rid] = self.replicas.pop(rid)
        self._controller.remove_source(rid)
        self._controller.load_state.leave(rid, self._controller.clock())
        if self._on_leave is not None:
            self._on_leave(rid)
        log.info("replica %s left the fleet: no new requests, %d in flight finish", rid,
                 self._controller.load_state.num_inflight(rid))

    def forget_drained(self) -> None:
        """Forget each leaving replica with nothing in flight any more."""
        load_state = self._controller.load_state
        for rid in [rid for rid in self.leaving if not load_state.holds_reservations(rid)]:
            del self.leaving[rid]
            load_state.forget(rid)
            self._controller.learned_limits.forget(rid)
            self._health.remove(rid)
            if self._shared is not None:
                self._shared.remove_replica(rid)
            if self._on_forget is not None:
                self._on_forget(rid)
            log.info("replica %s drained and forgotten", rid)


async def start_fleet(controller: Any, health: Any, shards: Any, watcher: Any) -> None:
    """Start what follows the fleet, as every front end does: the shared-polling heartbeat
    first (the first poll is then already a shard), the controller's poller and queue, the
    health probes, then the ``replicas_from`` watcher. ``shards``/``watcher``: None when off."""
    if shards is not None:
        await shards.heartbeat()
        shards.start()
    await controller.start()
    health.start()
    if watcher is not None:
        watcher.start()


async def stop_fleet(controller: Any, health: Any, shards: Any, watcher: Any) -> None:
    """Stop what :func:`start_fleet` started and close the controller."""
    if watcher is not None:
        await watcher.stop()
    await health.stop()
    if shards is not None:
        await shards.stop()
    await controller.aclose()
    controller.close()
