"""``ModelCatalog``: which replicas serve which model, for routing a request by its ``model``.

A replica's models are the names its ``[[replicas]] models`` lists (aliases: any of them routes
there), or else the ids its ``GET /v1/models`` answers, read at start-up and then every
``refresh_interval_s``, but no more often than every ``MIN_LIST_INTERVAL_S`` (a served model
changes when a replica restarts, not between two load polls). A request is priced and decided only among the replicas
serving its ``model`` (:attr:`policies.cost.RequestCost.replica_ids`); a model no replica
serves is a 404 ``model_not_found`` at the proxy, and no replica sees it.

A list once read is not read again from a replica this proxy has a request in flight to
(``busy``): that read can cost the request. llama-cpp-python's server takes its model's lock
for ``GET /v1/models`` as for a completion, and a stream that sees another request waiting
for that lock ends there (``[DONE]`` without a ``finish_reason``): every stream longer than the
refresh interval would be cut by the proxy's own read. The list read before stands meanwhile.

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

__all__ = ["MIN_LIST_INTERVAL_S", "ModelCatalog", "parse_model_ids", "parse_model_lengths"]

MIN_LIST_INTERVAL_S = 2.0

_log = logging.getLogger(__name__)

# (status, body) of GET url with headers, or raises (the proxy's transport.get)
Get = Callable[[str, float, list], Awaitable[tuple[int, bytes]]]
# busy(replica_id) -> the number of this proxy's requests in flight to the replica
Busy = Callable[[str], int]


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
        self._index()

    def add(self, replica: ReplicaConfig) -> None:
        """A replica joined the fleet: its configured models, else read with the others'."""
        self._models[replica.replica_id] = frozenset(replica.models) if replica.models else None
        if not replica.models and replica.url:
            self.polled_urls[replica.replica_id] = replica.url
        if replica.api_key:
            self._headers[replica.replica_id] = [
                (b"authorization", b"Bearer " + replica.api_key.encode())]
        self._index()

    def remove(self, replica_id: str) -> None:
        """A replica left the fleet: requests for its models route among the others."""
        for table in (self._models, self.polled_urls, self._headers):
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
        self._index()
        _log.info("replica %s serves %s", replica_id, ", ".join(sorted(models)) or "no model")

    async def refresh(self, get: Get, timeout_s: float, busy: Busy | None = None) -> None:
        """Read every unconfigured replica's ``/v1/models`` once (failures keep the last list);
        a replica ``busy`` counts requests in flight to is left out once its list was read."""
        ids = [rid for rid in self.polled_urls
               if busy is None or self._models[rid] is None or not busy(rid)]
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
                  busy: Busy | None = None) -> None:
        """:meth:`refresh` every ``interval_s`` (at least ``MIN_LIST_INTERVAL_S``) until
        cancelled."""
        while True:
            await asyncio.sleep(max(interval_s, MIN_LIST_INTERVAL_S))
            await self.refresh(get, timeout_s, busy)

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
