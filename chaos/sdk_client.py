"""The official OpenAI Python SDK as a chaos user client, every attempt it makes on the record.

One ``openai.AsyncOpenAI`` serves every user of the run (as one application process would),
with the SDK's own retry loop untouched (default ``max_retries`` = 2). Its HTTP client gets a
recording transport that (1) picks the entry URL per attempt, round-robin (a load balancer in
front of M proxies, which sends a refused connect on to the next entry: ``EntryPicker``),
(2) times each attempt and keeps its status and retry headers, and (3) watches the SSE bytes
for ``[DONE]`` and ``data: {"error": ...}`` events, so a truncated or failed stream is never
mistaken for an answer (the SDK itself ends quietly on a cut stream).
Token times are taken where the user sees them: as the SDK yields each chunk.

The token-id prompt travels in ``extra_body`` (it replaces the ``prompt=""`` placeholder in
the JSON the SDK sends, so the bytes on the wire are the same): given as ``prompt=``, the SDK
walks the list element by element through its type-directed param transform, ~20 ms of CPU for
a 1,280-token prompt, which would make the generator, not the server, the bottleneck. The SDK's
retries, headers and timeouts are untouched.

The SDK's timeout is per read (httpx semantics), so a stream that trickles never times out on
its own; the harness's hang check catches that.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx2
import openai

from chaos.client import Observation, observation_record
from chaos.clients import ClientConfig, EntryPicker, UserProgress, user_record
from chaos.records import RequestSpec
from chaos.user_record import UserRecord

__all__ = ["SdkUserClient", "USER_HEADER"]

USER_HEADER = "x-chaos-user"
CONNECT_TIMEOUT_S = 5.0
_ERROR_BYTES = 300


@dataclass
class _UserState:
    spec: RequestSpec
    t0_s: float
    progress: UserProgress
    obs: Observation | None = None
    start_s: float = 0.0


class _WatchedStream(httpx2.AsyncByteStream):
    """Passes the body through; notes ``[DONE]``, SSE error events, errors and the end."""

    def __init__(self, inner, finish: Callable[[BaseException | None], None],
                 obs: Observation) -> None:
        self._inner, self._finish, self._obs = inner, finish, obs
        self._pending = b""

    async def __aiter__(self):
        try:
            async for chunk in self._inner:
                self._scan(chunk)
                yield chunk
        except BaseException as exc:
            self._finish(exc)
            raise

    def _scan(self, chunk: bytes) -> None:
        *lines, self._pending = (self._pending + chunk).split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self._obs.saw_done = True
            elif b'"error"' in payload and self._obs.error is None:
                try:
                    err = json.loads(payload).get("error")
                except ValueError:
                    continue
                if err:
                    self._obs.error = f"stream error: {json.dumps(err)[:_ERROR_BYTES]}"

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            self._finish(None)


class _RecordingTransport(httpx2.AsyncBaseTransport):
    def __init__(self, inner: httpx2.AsyncBaseTransport, entries: EntryPicker,
                 users: dict[int, _UserState], clock: Callable[[], float]) -> None:
        self._inner, self._entries, self._users, self._clock = inner, entries, users, clock

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        state = self._users[int(request.headers[USER_HEADER])]
        obs = Observation()
        state.obs, state.start_s = obs, self._clock()
        obs.sent_s = state.start_s - state.t0_s
        state.progress.attempt_started_s = state.start_s
        finish = _finisher(state, obs, self._clock)
        try:
            resp = await self._send(request, obs)
        except BaseException as exc:
            finish(exc)
            raise
        obs.status = resp.status_code
        obs.headers = {k.lower(): v for k, v in resp.headers.items()}
        if not 200 <= resp.status_code < 300:
            obs.error = f"HTTP {resp.status_code}"
        return httpx2.Response(resp.status_code, headers=resp.headers, request=request,
                               stream=_WatchedStream(resp.stream, finish, obs),
                               extensions=resp.extensions)

    async def _send(self, request: httpx2.Request, obs: Observation) -> httpx2.Response:
        """To the entry the balancer picks; a refused connect goes on to the entry it names
        instead (the request never left, so this is one attempt, as behind nginx)."""
        url, tried = self._entries.next(), set()
        while True:
            target = httpx2.URL(url)
            request.url = request.url.copy_with(host=target.host, port=target.port)
            request.headers["host"] = f"{target.host}:{target.port}"
            obs.entry = url
            try:
                return await self._inner.handle_async_request(request)
            except httpx2.ConnectError:
                tried.add(url)
                nxt = self._entries.connect_failed(url)
                if nxt is None or nxt in tried:
                    raise
                url = nxt

    async def aclose(self) -> None:
        await self._inner.aclose()


def _finisher(state: _UserState, obs: Observation, clock) -> Callable:
    """Close the attempt once: its record goes into the user's progress."""
    done = []

    def finish(exc: BaseException | None) -> None:
        if done:
            return
        done.append(True)
        obs.end_s = clock()
        if isinstance(exc, asyncio.CancelledError) and obs.saw_done:
            # after [DONE] the SDK drains the body for 0.1 s, then cancels the read and
            # returns the answer: a response whose end lags [DONE] (through a gateway, its end
            # is one more message) is whole, not canceled
            exc = None
        if isinstance(exc, (httpx2.TimeoutException, asyncio.CancelledError)):
            obs.canceled = True
            obs.error = obs.error or ("client timeout" if isinstance(
                exc, httpx2.TimeoutException) else "canceled at drain deadline")
        elif exc is not None and obs.error is None:
            obs.error = f"{type(exc).__name__}: {exc}"[:_ERROR_BYTES]
        state.progress.attempts.append(observation_record(state.spec, obs, state.start_s))
        state.progress.attempt_started_s = None
    return finish


class SdkUserClient:
    """``openai.AsyncOpenAI`` with default retries, its attempts recorded per user."""

    def __init__(self, cfg: ClientConfig, entries: EntryPicker, *, model: str | None,
                 class_header: str = "x-kvguard-class",
                 clock: Callable[[], float] = time.monotonic,
                 max_connections: int = 4096) -> None:
        if cfg.kind != "sdk":
            raise ValueError(f"SdkUserClient serves the sdk kind, not {cfg.kind!r}")
        self.cfg, self._model, self._class_header, self._clock = cfg, model, class_header, clock
        self._users: dict[int, _UserState] = {}
        limits = httpx2.Limits(max_connections=max_connections,
                               max_keepalive_connections=max_connections)
        timeout = httpx2.Timeout(cfg.attempt_limit_s,
                                 connect=min(CONNECT_TIMEOUT_S, cfg.attempt_limit_s))
        transport = _RecordingTransport(httpx2.AsyncHTTPTransport(limits=limits), entries,
                                        self._users, clock)
        self._http = httpx2.AsyncClient(transport=transport, timeout=timeout, trust_env=False)
        self._sdk = openai.AsyncOpenAI(base_url=entries.urls[0] + "/v1", api_key="chaos",
                                       http_client=self._http, max_retries=cfg.retries,
                                       timeout=timeout)

    async def aclose(self) -> None:
        await self._sdk.close()

    async def serve(self, spec: RequestSpec, prompt_ids: list[int], t0_s: float,
                    progress: UserProgress) -> UserRecord:
        state = _UserState(spec, t0_s, progress)
        self._users[spec.index] = state
        final = None
        try:
            stream = await self._sdk.completions.create(
                model=self._model or "default", prompt="", max_tokens=spec.max_tokens,
                stream=True, temperature=0.0, stream_options={"include_usage": True},
                extra_body={"prompt": prompt_ids, "ignore_eos": True},
                extra_headers={"authorization": f"Bearer {spec.tenant}",
                               self._class_header: spec.request_class,
                               USER_HEADER: str(spec.index)})
            async for chunk in stream:
                self._on_chunk(chunk, state.obs)
        except openai.OpenAIError as exc:
            final = f"{type(exc).__name__}: {exc}"[:_ERROR_BYTES]
        finally:
            self._users.pop(spec.index, None)
        return user_record(spec, self.cfg, progress.attempts, final_error=final)

    def _on_chunk(self, chunk, obs: Observation | None) -> None:
        if obs is None:
            return
        if chunk.usage is not None:
            obs.usage = chunk.usage.model_dump(include={"prompt_tokens", "completion_tokens",
                                                        "total_tokens"})
        now = self._clock()
        for choice in chunk.choices:
            obs.finish_reason = choice.finish_reason or obs.finish_reason
            ids = getattr(choice, "token_ids", None)  # kvguard engines send the ids too
            obs.add_tokens(len(ids) if isinstance(ids, list) else int(bool(choice.text)), now)
