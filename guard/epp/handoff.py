"""``Handoffs``: admitted requests whose response an observer stream will report.

With the split Envoy config (``deploy/envoy/envoy-split.yaml``) the decision filter's ext_proc
stream carries only the request: it ends once the EPP has answered, and the response goes to a
second ext_proc filter in Envoy's observability mode, which sends the response headers and body
without waiting for answers (so the first token never waits on the EPP). The decision hands
the request's :class:`~guard.epp.picker.PickerExchange` (its ticket) over here under a fresh
random token, which Envoy carries to the observer stream as dynamic metadata
(``kvguard``/``ticket``): no client header can set it. The observer stream claims the exchange
with that token, once, and feeds the ticket as the single-stream path does. With several EPPs
behind one Envoy the decision also names its EPP (``kvguard``/``epp``), and Envoy's routes
send the observer stream to that EPP (``chaos.envoy_front.envoy_config``).

A token nobody claims within ``wait_s`` (the observer filter is missing, or its stream was lost
before it started) is released then, with the outcome the ticket has (``failed``: no response
was seen), so a ticket is never held past that bound without an observer.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from typing import Any

from guard.epp.picker import PickerExchange

__all__ = ["DEFAULT_WAIT_S", "Handoffs"]

DEFAULT_WAIT_S = 5.0
_log = logging.getLogger(__name__)

# schedule(delay_s, callback) -> a handle with cancel(): the event loop's call_later by default
Schedule = Callable[[float, Callable[[], None]], Any]


class Handoffs:
    """Exchanges waiting for their observer stream, by token; ``wait_s``: how long a token may
    wait to be claimed before its ticket is released unobserved. ``epp_id``: this EPP's name
    for Envoy's routes, sent beside each token (``kvguard``/``epp``) so that, with several
    EPPs, the route matching it sends the observer stream back here (None: one EPP)."""

    def __init__(self, wait_s: float = DEFAULT_WAIT_S, schedule: Schedule | None = None,
                 epp_id: str | None = None) -> None:
        if not wait_s > 0:
            raise ValueError(f"observer wait: must be > 0 s, got {wait_s}")
        if epp_id is not None and not epp_id:
            raise ValueError("epp id: must not be empty")
        self.wait_s = wait_s
        self.epp_id = epp_id
        self._schedule = schedule
        self._waiting: dict[str, tuple[PickerExchange, Any]] = {}
        self.num_unobserved = 0  # tokens released because no observer claimed them in time

    def __len__(self) -> int:
        return len(self._waiting)

    def hand_off(self, exchange: PickerExchange) -> str:
        """Keep ``exchange`` for its observer; the token that claims it."""
        token = secrets.token_hex(16)
        schedule = self._schedule or asyncio.get_running_loop().call_later
        timer = schedule(self.wait_s, lambda: self._expire(token))
        self._waiting[token] = (exchange, timer)
        return token

    def claim(self, token: str | None) -> PickerExchange | None:
        """The exchange handed off under ``token``, once; None for an unknown, already claimed
        or expired token."""
        entry = self._waiting.pop(token, None) if token else None
        if entry is None:
            return None
        exchange, timer = entry
        timer.cancel()
        return exchange

    def _expire(self, token: str) -> None:
        entry = self._waiting.pop(token, None)
        if entry is None:
            return
        self.num_unobserved += 1
        exchange = entry[0]
        _log.warning("no observer stream claimed request %s within %.1f s: ticket released "
                     "unobserved", exchange.request_id, self.wait_s)
        exchange.close(reset=False)

    def close(self) -> None:
        """Release every ticket still waiting (the server stops)."""
        waiting, self._waiting = self._waiting, {}
        for exchange, timer in waiting.values():
            timer.cancel()
            exchange.close(reset=False)
