"""``ModelCatalog``: which replicas serve which model, for routing a request by its ``model``.

A replica's models are the names its ``[[replicas]] models`` lists (aliases: any of them routes
there), or else the ids its ``GET /v1/models`` answers. A request is priced and decided only
among the replicas serving its ``model`` (:attr:`policies.cost.RequestCost.replica_ids`); a
model no replica serves is a 404 ``model_not_found`` at the proxy, and no replica sees it.

The lists are read at start-up and then in rounds, every ``refresh_interval_s`` but no more
often than every ``MIN_LIST_INTERVAL_S``. A served model changes when a replica restarts, not
between two load polls, so a round does not read the whole fleet: the catalog's reads grow
with what changes, not with the number of replicas. A round reads

* every replica whose list was never read (it may still be starting), as every round before;
* of the others, at most ``MAX_LISTS_PER_ROUND``, the least recently read first: round robin,
  each re-read every ``ceil(N / MAX_LISTS_PER_ROUND)`` rounds (later when busy, below). A
  fleet of up to that many replicas has every list read every round;
* a replica whose own state document (``/kvguard/state``, through the ``state_model`` that
  :meth:`ModelCatalog.run` is given) names a model its list lacks, whatever its turn: it
  restarted serving another model. A prompted read that leaves the list as it was (a state
  that names the model otherwise than ``/v1/models`` does, or a read that failed) prompts
  no other for that model: the list is read on its turn only, not every round.

So at 256 replicas, with rounds every 2 s, a replica whose state names its model (a kvguard
engine) has a new model seen at the first round after the proxy's poll brings its new state,
and one whose state does not (vLLM, SGLang, llama.cpp) within 16 rounds, 32 s (plus the
read's own time); the reads stay at most 16 a round, 8 a second, besides the never-read and
the prompted ones.

A list once read is not read again from a replica this proxy has a request in flight to
(``busy``): that read can cost the request. llama-cpp-python's server takes its model's lock
for ``GET /v1/models`` as for a completion, and a stream that sees another request waiting
for that lock ends there (``[DONE]`` without a ``finish_reason``): every stream longer than the
refresh interval would be cut by the proxy's own read. The list read before stands meanwhile.
A busy replica keeps its place: it stays the least recently read, and is read at the first
round it is idle (a prompted read likewise waits for that round).

A replica's ``/v1/models`` entry may give the model's context (``max_model_len``, as vLLM's
does): :meth:`ModelCatalog.max_model_len` answers it, so a prompt is checked against the
context of the model it asks for, not the smallest in the fleet.

A replica whose list was never read (it has not answered ``/v1/models`` yet) may serve any
model: requests are not refused for a list the proxy has not seen. A list once read stays
until a later read replaces it (a replica that stops answering is the poller's and the
health checks' business, not a reason to forget what it serves).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence

from guard.config import ReplicaConfig
from guard.errors import PricingError

__all__ = ["MAX_LISTS_PER_ROUND", "MIN_LIST_INTERVAL_S", "ModelCatalog", "parse_model_ids",
           "parse_model_lengths"]

MIN_LIST_INTERVAL_S = 2.0
# Lists a round re-reads besides the never-read and the prompted ones. 16 keeps a fleet of up
# to 16 replicas read every round as before (a model change there seen within one round), and
# bounds a larger fleet's reads at 8 a second, what 16 replicas cost.
MAX_LISTS_PER_ROUND = 16

_log = logging.getLogger(__name__)

# (status, body) of GET url with headers, or raises (the proxy's transport.get)
Get = Callable[[str, float, list], Awaitable[tuple[int, bytes]]]
# busy(replica_id) -> the number of this proxy's requests in flight to the replica
Busy = Callable[[str], int]
# state_model(replica_id) -> the model the replica's own state document names (None: none)
StateModel = Callable[[str], str | None]


class ModelCatalog:
    """Replica ids by model name; configured lists fixed, the others read from the replicas."""

    def __init__(self, replicas: Sequence[ReplicaConfig]) -> None:
        self._models: dict[str, frozenset[str] | None] = {
            r.replica_id: frozenset(r.models) if r.models else None for r in replicas}
        self.polled_urls = {r.replica_id: r.url for r in replicas if not r.models and r.url}
        self._headers = {r.replica_id: [(b"authorization", b"Bearer " + r.api_key.encode())]
                         for r in replicas if r.api_key}  # the replica's own key
        self._by_model: dict[str, frozenset[str]] = {}
        self._lengths: dict[tuple[str, str], int] = {}  # (replica, model) -> max_model_len
        self._unread: frozenset[str] = frozenset()
        # the polled replicas, least recently read first (a round reads from the front)
        self._turns: dict[str, None] = dict.fromkeys(self.polled_urls)
        # replica -> the model its state named at its last read out of turn, until its list
        # changes (a mismatch that a read leaves as it was prompts no other)
        self._prompted: dict[str, str] = {}
        self._index()

    def add(self, replica: ReplicaConfig) -> None:
        """A replica joined the fleet: its configured models, else read with the others'."""
        self._models[replica.replica_id] = frozenset(replica.models) if replica.models else None
        self._prompted.pop(replica.replica_id, None)
        if not replica.models and replica.url:
            self.polled_urls[replica.replica_id] = replica.url
            self._turns.pop(replica.replica_id, None)  # never read now: read every round
            self._turns[replica.replica_id] = None
        if replica.api_key:
            self._headers[replica.replica_id] = [
                (b"authorization", b"Bearer " + replica.api_key.encode())]
        self._index()

    def remove(self, replica_id: str) -> None:
        """A replica left the fleet: requests for its models route among the others."""
        for table in (self._models, self.polled_urls, self._headers, self._turns,
                      self._prompted):
            table.pop(replica_id, None)
        self._set_lengths(replica_id, {})
        self._index()

    def headers_for(self, replica_id: str) -> list[tuple[bytes, bytes]]:
        """What a GET to the replica carries: its own ``Authorization``, when it has a key."""
        return self._headers.get(replica_id, [])

    def models_of(self, replica_id: str) -> frozenset[str] | None:
        """The names ``replica_id`` serves (None: not read yet, or not in the fleet)."""
        return self._models.get(replica_id)

    def max_model_len(self, replica_id: str, model: str) -> int | None:
        """The context ``replica_id`` serves ``model`` with, as its ``/v1/models`` said (None:
        it did not say)."""
        return self._lengths.get((replica_id, model))

    def replicas_for(self, model: object) -> frozenset[str] | None:
        """The replica ids that may serve ``model`` (None: any, the request names no model);
        PricingError 404 ``model_not_found`` when none does."""
        if not isinstance(model, str):
            return None
        serving = self._by_model.get(model)
        if self._unread:
            return self._unread if serving is None else serving | self._unread
        if serving is None:
            raise PricingError(404, "model_not_found",
                               f"The model `{model[:200]}` does not exist: no replica serves it "
                               "(GET /v1/models lists the models served)", "model")
        return serving

    def update(self, replica_id: str, models: frozenset[str]) -> None:
        """A replica's list as read from its ``/v1/models``."""
        if replica_id not in self._models:  # it left while its list was on the way
            return
        before = self._models[replica_id]
        if before == models:
            return
        self._models[replica_id] = models
        self._prompted.pop(replica_id, None)  # a new list: a state that names another prompts
        self._index()
        _log.info("replica %s serves %s", replica_id, ", ".join(sorted(models)) or "no model")

    async def refresh(self, get: Get, timeout_s: float, busy: Busy | None = None,
                      state_model: StateModel | None = None) -> None:
        """Read one round's ``/v1/models`` lists (the module docstring says which; failures
        keep the last list): ``busy`` counts a replica's requests in flight, ``state_model``
        gives the model its state document names."""
        ids = self._round(busy, state_model)
        for rid in ids:  # to the back of the turns, read or failed: the others' turn comes
            del self._turns[rid]
            self._turns[rid] = None
        answers = await asyncio.gather(
            *(get(self.polled_urls[rid] + "/v1/models", timeout_s, self.headers_for(rid))
              for rid in ids),
            return_exceptions=True)
        for rid, answer in zip(ids, answers, strict=True):
            if rid not in self.polled_urls:  # left the fleet while its list was read
                continue
            if isinstance(answer, tuple) and answer[0] == 200:
                models = parse_model_ids(answer[1])
                if models is not None:
                    self.update(rid, models)
                    self._set_lengths(rid, parse_model_lengths(answer[1]))

    async def run(self, get: Get, interval_s: float, timeout_s: float,
                  busy: Busy | None = None, state_model: StateModel | None = None) -> None:
        """:meth:`refresh` every ``interval_s`` (at least ``MIN_LIST_INTERVAL_S``) until
        cancelled."""
        while True:
            await asyncio.sleep(max(interval_s, MIN_LIST_INTERVAL_S))
            await self.refresh(get, timeout_s, busy, state_model)

    def _round(self, busy: Busy | None, state_model: StateModel | None) -> list[str]:
        """The replicas a round reads: the never read, the idle ones whose state names a model
        their list lacks, and up to ``MAX_LISTS_PER_ROUND`` idle others, least recently read
        first. A busy one is passed over and so stays at the front for the next round."""
        ids = []
        in_turn = 0
        for rid in self._turns:
            models = self._models[rid]
            if models is not None and busy is not None and busy(rid):
                continue
            if models is None or self._prompt(rid, models, state_model):
                ids.append(rid)
            elif in_turn < MAX_LISTS_PER_ROUND:
                ids.append(rid)
                in_turn += 1
        return ids

    def _prompt(self, replica_id: str, models: frozenset[str],
                state_model: StateModel | None) -> bool:
        """True when the replica's state names a model its list lacks and no read was prompted
        for that model since the list last changed (then one is, now)."""
        if state_model is None:
            return False
        named = state_model(replica_id)
        if named is None or named in models or self._prompted.get(replica_id) == named:
            return False
        self._prompted[replica_id] = named
        return True

    def _set_lengths(self, replica_id: str, lengths: dict[str, int]) -> None:
        for key in [k for k in self._lengths if k[0] == replica_id]:
            del self._lengths[key]
        for model, length in lengths.items():
            self._lengths[(replica_id, model)] = length

    def _index(self) -> None:
        by_model: dict[str, set[str]] = {}
        for rid, models in self._models.items():
            for model in models or ():
                by_model.setdefault(model, set()).add(rid)
        self._by_model = {m: frozenset(rids) for m, rids in by_model.items()}
        self._unread = frozenset(rid for rid, models in self._models.items() if models is None)


def parse_model_ids(body: bytes) -> frozenset[str] | None:
    """The ``id`` of every entry of an OpenAI ``/v1/models`` list (None: not such a list)."""
    try:
        data = json.loads(body).get("data")
        return frozenset(m["id"] for m in data if isinstance(m.get("id"), str))
    except (ValueError, TypeError, AttributeError, KeyError):
        return None


def parse_model_lengths(body: bytes) -> dict[str, int]:
    """``id -> max_model_len`` for each entry of an OpenAI ``/v1/models`` list that gives a
    positive integer one (vLLM's do); the others are left out."""
    try:
        data = json.loads(body).get("data")
        return {m["id"]: m["max_model_len"] for m in data
                if isinstance(m.get("id"), str) and isinstance(m.get("max_model_len"), int)
                and not isinstance(m["max_model_len"], bool) and m["max_model_len"] > 0}
    except (ValueError, TypeError, AttributeError, KeyError):
        return {}
