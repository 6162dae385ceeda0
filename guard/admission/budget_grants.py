"""``BudgetGrants``: the tenant-budget grants one guard holds, from reserve to settle or release.

The controller reserves a request's prompt + priced ``max_tokens`` before its policy decision
(:meth:`BudgetGrants.try_reserve`, else ``await`` :meth:`BudgetGrants.reserve`); every grant then
ends exactly once: :meth:`end` from the ticket's release (completed: settled with its usage;
any other outcome: released), or :meth:`drop` when its request never ran (shed, left the queue,
an error). Held grants are renewed every ``lease_s / 3`` (:meth:`renew_if_due`).

Stores that can answer without awaiting (the in-memory store's ``reserve_now``; every built-in
store's ``finish_soon``) are called directly: no coroutine for a reserve the store decides at
once, no task per settle. Any other :class:`~guard.budget.store.BudgetStore` is awaited, its
settles and releases run as background tasks that :meth:`aclose` waits for.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

from guard.admission.ticket import Ticket
from guard.budget.store import BudgetStore, Denied, Grant

__all__ = ["BudgetGrants", "used_tokens"]


class BudgetGrants:
    """The grants held on ``store`` (queued or in flight), each leased for ``lease_s``."""

    def __init__(self, store: BudgetStore, lease_s: float) -> None:
        if lease_s <= 0:
            raise ValueError(f"budget_lease_s: must be > 0, got {lease_s!r}")
        self.store = store
        self.lease_s = lease_s
        self.held: dict[str, Grant] = {}
        self._reserve_now = getattr(store, "reserve_now", None)
        self._finish_soon = getattr(store, "finish_soon", None)
        self._settling: set[asyncio.Task] = set()
        self._last_renew_s = time.monotonic()

    def try_reserve(self, tenant: str, tokens: int) -> Grant | Denied | None:
        """The store's answer when it can give one without awaiting; None: await :meth:`reserve`."""
        reserve_now = self._reserve_now
        if reserve_now is None:
            return None
        outcome = reserve_now(tenant, tokens, self.lease_s)
        if isinstance(outcome, Grant):  # held until the request ends (as _hold does)
            self.held[outcome.grant_id] = outcome
        return outcome

    async def reserve(self, tenant: str, tokens: int) -> Grant | Denied:
        return self._hold(await self.store.reserve(tenant, tokens, self.lease_s))

    def _hold(self, outcome: Grant | Denied | None) -> Grant | Denied | None:
        if isinstance(outcome, Grant):
            self.held[outcome.grant_id] = outcome
        return outcome

    def end(self, grant: Grant | None, used: int | None) -> None:
        """Settle ``grant`` with ``used`` tokens, or release it (None); once per grant."""
        if grant is None or self.held.pop(grant.grant_id, None) is None:
            return
        if self._finish_soon is not None:
            self._finish_soon(grant, used)
        elif used is None:
            self._spawn(self.store.release(grant))
        else:
            self._spawn(self.store.settle(grant, used))

    def drop(self, grant: Grant | None) -> None:
        """A grant whose request will never run: released."""
        self.end(grant, None)

    def on_released(self, ticket: Ticket) -> None:
        """Ticket release listener: a completed request is settled with its usage, every other
        outcome released."""
        grant = ticket.grant
        if grant is None:
            return
        used = used_tokens(ticket) if ticket.outcome == "completed" else None
        if self._finish_soon is not None and self.held.pop(grant.grant_id, None) is not None:
            self._finish_soon(grant, used)  # what end() does, for the stores that have it
        else:
            self.end(grant, used)

    async def renew_if_due(self) -> None:
        """Renew every held grant when ``lease_s / 3`` has passed since the last renewal."""
        if time.monotonic() - self._last_renew_s < self.lease_s / 3:
            return
        self._last_renew_s = time.monotonic()
        if self.held:
            await self.store.renew(tuple(self.held.values()), self.lease_s)

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def aclose(self) -> None:
        """Wait for the settles and releases still running as tasks."""
        if self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)


def used_tokens(ticket: Ticket) -> int:
    """Prompt + completion tokens from the upstream's ``usage``, else the guard's counts."""
    prompt = ticket.num_usage_prompt_tokens
    if prompt is None:
        prompt = ticket.cost.num_prompt_tokens
    return prompt + ticket.num_output_tokens
