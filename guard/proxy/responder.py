"""``Responder``: how the proxy answers the controller's result, on either path (ASGI or
kvguard's read callback): an admitted request relayed to its replica, a rejection sent.

What every response says about its request is decided here too: the client's sane
``x-request-id`` echoed (else the guard's id), and for a tenant with a budget OpenAI's
``x-ratelimit-*`` headers — its limits, on an admit what is left of them (when the budget
store knows), on a budget 429 the axis that said no and when it has room again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from guard.admission.admitted import Admitted
from guard.admission.rate_limit_headers import rate_limit_headers
from guard.admission.shedding import Rejection, send_rejection
from guard.config import GuardConfig
from guard.controller import AdmissionController
from guard.proxy.exchange import upstream_headers
from guard.proxy.upstream import BodyWriter, Forwarder
from guard.request.request_ids import id_headers

__all__ = ["Responder"]

Message = dict[str, Any]
RawHeaders = list[tuple[bytes, bytes]]
Send = Callable[[Message], Awaitable[None]]


class Responder:
    """Answers results for one proxy (``not_forwarded``: the client headers that stay here)."""

    def __init__(self, config: GuardConfig, controller: AdmissionController,
                 forwarder: Forwarder, not_forwarded: frozenset[bytes]) -> None:
        self.config = config
        self.controller = controller
        self.forwarder = forwarder
        self.not_forwarded = not_forwarded
        self._budgeted = config.budgets_enabled  # x-ratelimit-* headers for budgeted tenants

    async def answer(self, result: Admitted | Rejection | None, raw_target: str,
                     raw_headers: RawHeaders, client_gone: Callable[[], asyncio.Future],
                     send: Send, writer: BodyWriter | None, client_id: str | None,
                     authorization: str | None) -> None:
        """The controller's result answered: relayed from the replica (to ``raw_target``, the
        client's target as sent), or the rejection; either echoes ``client_id`` (the client's
        sane ``x-request-id``) or the guard's id."""
        if isinstance(result, Admitted):
            self.annotate(result, client_id)
            return await self.forwarder.forward(
                result, raw_target,
                upstream_headers(raw_headers, result.request_id, self.not_forwarded),
                client_gone(), send, writer)
        if result is not None:
            await send_rejection(send, result,
                                 self.rejection_headers(result, authorization, client_id))

    def annotate(self, admitted: Admitted, client_id: str | None) -> None:
        """An admitted request's response: the client's id echoed, its tenant's rate limits
        and what is left of them (when the budget store knows)."""
        admitted.client_request_id = client_id
        if self._budgeted:
            tenant = admitted.ticket.cost.tenant
            limits = self.config.budget_limits(tenant)
            grants = self.controller.grants
            remaining = getattr(grants.store, "remaining_now", None) if grants is not None else None
            admitted.response_headers = rate_limit_headers(
                limits, remaining=None if remaining is None else remaining(tenant))

    def rejection_headers(self, rejection: Rejection, authorization: str | None,
                          client_id: str | None) -> RawHeaders:
        """A rejection's ids and, for a budgeted tenant, its rate limits (on a budget 429:
        the axis that said no, and when it has room again)."""
        headers = id_headers(client_id, rejection.request_id)
        if self._budgeted:
            tenant = self.controller.tenant(authorization)
            if tenant is not None:
                limits = self.config.budget_limits(tenant.name)
                if rejection.status == 429:
                    headers += rate_limit_headers(limits, rejection.reason,
                                                  rejection.retry_after_s)
                else:
                    headers += rate_limit_headers(limits)
        return headers
