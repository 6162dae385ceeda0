"""Clients as they exist in the wild, each serving one user (one arrival) of a chaos run.

Four kinds, chosen by ``ClientConfig.kind``:

- ``sdk``: the official OpenAI Python SDK with its default retries (``chaos.sdk_client``):
  2 retries on 408/409/429/5xx, connection errors and timeouts; it obeys ``x-should-retry``,
  waits ``retry-after-ms`` (then ``retry-after``) when it is 0–120 s and refuses to retry past
  120 s, else backs off 0.5 s × 2^n (max 8 s) minus up to 25 % jitter.
- ``tenacity``: a careful hand-written client: retries 429, 503 and connection errors with
  exponential backoff and full jitter (``wait_random_exponential``), up to ``max_retries``.
- ``bad_citizen``: retries anything that did not complete, at once, up to ``max_retries``
  times, ignoring every header (only plainly malformed requests — 400/401/403/404/413/422 —
  end it).
- ``timeout_retry``: gives up on an attempt after ``attempt_timeout_s`` and retries at once
  (the classic storm maker: the abandoned attempt's work is wasted); on 429/503 it waits the
  integer ``Retry-After`` it was given.

Every kind stops when the user's patience is spent. Each attempt is a ``RequestRecord``; the
user's result is a ``UserRecord``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
from tenacity import AsyncRetrying, retry_if_result, stop_after_attempt, wait_random_exponential

from chaos.client import CompletionClient, request_body, require_loopback
from chaos.records import RequestRecord, RequestSpec
from chaos.user_record import UserRecord

__all__ = ["CLIENT_KINDS", "DEFAULT_RETRIES", "ClientConfig", "UserProgress", "EntryPicker",
           "HttpUserClient", "user_record"]

CLIENT_KINDS: tuple[str, ...] = ("sdk", "tenacity", "bad_citizen", "timeout_retry")
DEFAULT_RETRIES: dict[str, int] = {"sdk": 2, "tenacity": 4, "bad_citizen": 5, "timeout_retry": 3}
NEVER_RETRY_STATUSES: frozenset[int] = frozenset({400, 401, 403, 404, 413, 422})
MIN_ATTEMPT_S = 0.05


@dataclass(frozen=True)
class ClientConfig:
    """One client kind and its knobs; seconds are wall seconds of the run."""

    kind: str
    patience_s: float                      # how long the user waits in all, from arrival
    attempt_timeout_s: float | None = None  # per attempt; None: the remaining patience
    max_retries: int | None = None          # None: the kind's default (DEFAULT_RETRIES)
    backoff_s: float = 0.5                  # tenacity: first backoff scale
    backoff_max_s: float = 8.0              # tenacity: backoff cap

    def __post_init__(self) -> None:
        if self.kind not in CLIENT_KINDS:
            raise ValueError(f"client kind must be one of {CLIENT_KINDS}, got {self.kind!r}")
        if self.patience_s <= 0:
            raise ValueError(f"patience_s must be > 0, got {self.patience_s}")
        if self.attempt_timeout_s is not None and self.attempt_timeout_s <= 0:
            raise ValueError(f"attempt_timeout_s must be > 0, got {self.attempt_timeout_s}")
        if self.kind == "timeout_retry" and self.attempt_timeout_s is None:
            raise ValueError("the timeout_retry client needs attempt_timeout_s")
        if self.max_retries is not None and self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.backoff_s <= 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError("need 0 < backoff_s <= backoff_max_s")

    @property
    def retries(self) -> int:
        return DEFAULT_RETRIES[self.kind] if self.max_retries is None else self.max_retries

    @property
    def attempt_limit_s(self) -> float:
        """The longest one attempt may legitimately last (past it, the client is hung)."""
        return self.attempt_timeout_s or self.patience_s


class UserProgress:
    """A user's attempts so far and the one in flight; the harness reads it when it must
    cancel the client (hang check, partial record). Touched only on the event loop."""

    def __init__(self) -> None:
        self.attempts: list[RequestRecord] = []
        self.attempt_started_s: float | None = None  # clock time of the attempt in flight


class EntryPicker:
    """The load balancer in front of M proxies, as the scenario's clients reach it.

    Round-robin per attempt, with what nginx does by default for a server that refuses
    connections (``proxy_next_upstream error``, ``max_fails=1``, ``fail_timeout=10s``): a
    connect that fails goes on to the next entry within the same attempt, so the client never
    sees it, and the entry that failed is left out of the round-robin for ``fail_timeout_s``,
    then tried again. Only connects are re-sent: once a connection is made the request may have
    reached the proxy, and a POST is not re-sent (nginx does not either), so a stream cut by a
    proxy crash stays the client's to handle. When every entry is out, the round-robin goes on
    over all of them (nginx then tries them all too).
    """

    def __init__(self, urls: Sequence[str], *, fail_timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not urls:
            raise ValueError("need at least one entry URL")
        if fail_timeout_s < 0:
            raise ValueError(f"fail_timeout_s must be >= 0, got {fail_timeout_s}")
        for u in urls:
            require_loopback(u)
        self.urls = tuple(u.rstrip("/") for u in urls)
        self.fail_timeout_s = fail_timeout_s
        self._clock = clock
        self._cycle = itertools.cycle(range(len(self.urls)))
        self._out_until: dict[str, float] = {}  # entry -> when it is tried again
        self.connect_failures: dict[str, int] = {}  # per entry, over the run
        self.failovers = 0  # connects that went on to another entry

    def next(self) -> str:
        if self._out_until:
            now = self._clock()
            for url, until in list(self._out_until.items()):
                if until <= now:
                    del self._out_until[url]
        for _ in range(len(self.urls)):
            url = self.urls[next(self._cycle)]
            if url not in self._out_until:
                return url
        return self.urls[next(self._cycle)]

    def connect_failed(self, url: str) -> str | None:
        """``url`` refused a connect: leave it out for ``fail_timeout_s`` and name the entry
        to connect to instead (None when every entry is out or there is only one)."""
        url = url.rstrip("/")
        if url not in self.urls:
            raise ValueError(f"{url!r} is not one of the entries {self.urls}")
        self.connect_failures[url] = self.connect_failures.get(url, 0) + 1
        self._out_until[url] = self._clock() + self.fail_timeout_s
        nxt = self.next()
        if nxt in self._out_until:
            return None
        self.failovers += 1
        return nxt

    def summary(self) -> dict:
        return {"connect_failures": dict(self.connect_failures), "failovers": self.failovers,
                "fail_timeout_s": self.fail_timeout_s}


def user_record(spec: RequestSpec, cfg: ClientConfig, attempts: Sequence[RequestRecord], *,
                hung: bool = False, final_error: str | None = None) -> UserRecord:
    return UserRecord(spec.index, cfg.kind, spec.scheduled_s, spec.request_class, spec.tenant,
                      cfg.patience_s, tuple(attempts), hung=hung, final_error=final_error)


def _stop_if_canceled() -> None:
    """``CompletionClient.send`` turns a cancel into a canceled record; keep the cancel."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _retry_after_s(record: RequestRecord) -> float:
    return record.retry_after_s if record.retry_after_s and record.retry_after_s > 0 else 0.0


class HttpUserClient:
    """The ``tenacity``, ``bad_citizen`` and ``timeout_retry`` kinds, over a shared aiohttp
    session."""

    def __init__(self, cfg: ClientConfig, http: aiohttp.ClientSession, entries: EntryPicker, *,
                 model: str | None, class_header: str = "x-kvguard-class",
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], object] = asyncio.sleep) -> None:
        if cfg.kind == "sdk":
            raise ValueError("the sdk kind is chaos.sdk_client.SdkUserClient")
        self.cfg, self._http, self._entries = cfg, http, entries
        self._model, self._class_header = model, class_header
        self._clock, self._sleep = clock, sleep

    async def serve(self, spec: RequestSpec, prompt_ids: list[int], t0_s: float,
                    progress: UserProgress) -> UserRecord:
        body = request_body(self._model, json.dumps(prompt_ids), spec.max_tokens)
        arrival_s = t0_s + spec.scheduled_s
        if self.cfg.kind == "tenacity":
            await self._tenacity(spec, body, t0_s, arrival_s, progress.attempts, progress)
        else:
            await self._loop(spec, body, t0_s, arrival_s, progress.attempts, progress)
        return user_record(spec, self.cfg, progress.attempts)

    def _remaining_s(self, arrival_s: float) -> float:
        return arrival_s + self.cfg.patience_s - self._clock()

    async def _attempt(self, spec, body, t0_s, arrival_s, progress) -> RequestRecord | None:
        remaining = self._remaining_s(arrival_s)
        if remaining < MIN_ATTEMPT_S:
            return None
        timeout_s = min(self.cfg.attempt_timeout_s or remaining, remaining)
        client = CompletionClient(self._http, self._entries.next(), model=self._model,
                                  timeout_s=timeout_s, class_header=self._class_header,
                                  clock=self._clock, failover=self._entries.connect_failed)
        progress.attempt_started_s = self._clock()
        try:
            return await client.send(spec, body, t0_s)
        finally:
            progress.attempt_started_s = None

    def _retryable(self, r: RequestRecord) -> bool:
        if r.successful or r.status in NEVER_RETRY_STATUSES:
            return False
        if self.cfg.kind == "bad_citizen":
            return True
        if self.cfg.kind == "tenacity":
            return r.status in (429, 503) or (r.status is None and r.outcome == "failed")
        return True  # timeout_retry: its own timeouts, errors, sheds

    async def _loop(self, spec, body, t0_s, arrival_s, attempts, progress) -> None:
        for _ in range(1 + self.cfg.retries):
            record = await self._attempt(spec, body, t0_s, arrival_s, progress)
            if record is None:
                return
            attempts.append(record)
            _stop_if_canceled()
            if not self._retryable(record):
                return
            if self.cfg.kind == "timeout_retry" and record.status in (429, 503):
                wait_s = min(_retry_after_s(record), self._remaining_s(arrival_s))
                if wait_s > 0:
                    await self._sleep(wait_s)

    async def _tenacity(self, spec, body, t0_s, arrival_s, attempts, progress) -> None:
        async def one() -> RequestRecord | None:
            record = await self._attempt(spec, body, t0_s, arrival_s, progress)
            if record is not None:
                attempts.append(record)
                _stop_if_canceled()
            return record

        retrying = AsyncRetrying(
            stop=stop_after_attempt(1 + self.cfg.retries),
            wait=wait_random_exponential(multiplier=self.cfg.backoff_s,
                                         max=self.cfg.backoff_max_s),
            retry=retry_if_result(lambda r: r is not None and self._retryable(r)),
            retry_error_callback=lambda state: state.outcome.result(),
            sleep=self._sleep)
        await retrying(one)
