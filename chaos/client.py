"""One streamed completion request, observed token by token.

``CompletionClient.send`` posts a ``/v1/completions`` request whose prompt is a list of token
ids (so the server's token count is exact), with ``max_tokens`` = the planned output,
``ignore_eos`` and ``stream_options.include_usage``, and turns everything it sees into a
frozen ``RequestRecord``. It never raises for a request-level problem: transport errors,
bad status codes, truncated streams, its own timeout and cancellation all become outcomes.

The HTTP client is one shared ``aiohttp.ClientSession``, not httpx (httpcore 1.0), which cannot
offer high rates: its connection pool rescans every connection, and for each idle one counts
every connection again, each time a request enters or leaves the pool, so with thousands of
connections the generator's CPU per request grows with the connections it holds. aiohttp's
pool does not rescan its connections per request (``kvguard bench loadgen`` measures the
generator's CPU per request; docs/benchmarks.md §10).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

from chaos.records import RequestRecord, RequestSpec, classify_outcome

__all__ = ["MAX_IDLE_S", "CompletionClient", "Observation", "observation_record",
           "require_loopback", "request_body", "make_http_client", "tokens_in"]

_ERROR_BODY_BYTES = 500


def require_loopback(url: str) -> None:
    """Refuse any URL whose host is not this machine: chaos traffic stays on loopback."""
    host = urlsplit(url).hostname
    if host is None:
        raise ValueError(f"URL {url!r} has no host")
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"refusing non-loopback URL {url!r}: kvguard load only targets "
                         "127.0.0.1 / localhost / ::1")


# How long an idle keep-alive connection is reused: below the timeouts servers close idle
# connections at (kvguard's and uvicorn's: 5 s). A request written just as the server closes
# the connection is lost with it, which no server can prevent; a client that retires its idle
# connections first never meets that race (the proxy does the same upstream: KEEPALIVE_S).
MAX_IDLE_S = 4.0


def make_http_client(max_connections: int, connect_timeout_s: float = 5.0
                     ) -> aiohttp.ClientSession:
    """One shared HTTP/1.1 session whose pool holds up to ``max_connections`` connections
    (a request past that waits for one); ``connect_timeout_s`` bounds each TCP connect. Call
    it on the running event loop and close it (``async with``)."""
    connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0,
                                     keepalive_timeout=MAX_IDLE_S)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False,
                                 auto_decompress=False)


def request_body(model: str | None, prompt_json: str, max_tokens: int) -> bytes:
    """The JSON body; ``prompt_json`` is the already-encoded token id list."""
    head = {"max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0, "stream_options": {"include_usage": True}}
    if model is not None:
        head["model"] = model
    return (json.dumps(head)[:-1] + ', "prompt": ' + prompt_json + "}").encode()


@dataclass
class Observation:
    """Mutable scratch state while one request is in flight."""

    sent_s: float | None = None
    status: int | None = None
    error: str | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    end_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    num_tokens: int = 0
    usage: dict | None = None
    finish_reason: str | None = None
    saw_done: bool = False
    canceled: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    entry: str | None = None  # the entry URL the request was sent to (after any failover)

    def add_tokens(self, num_tokens: int, now_s: float) -> None:
        """``num_tokens`` generated tokens arrived together at ``now_s``."""
        if num_tokens <= 0:
            return
        if self.first_token_s is None:
            self.first_token_s = now_s
        else:
            self.gaps_s.append(now_s - self.last_token_s)
        self.gaps_s.extend([0.0] * (num_tokens - 1))  # tokens that arrived in the same chunk
        self.last_token_s = now_s
        self.num_tokens += num_tokens


def _float_header(headers: dict[str, str], name: str) -> float | None:
    try:
        return float(headers[name])
    except (KeyError, ValueError):
        return None


def tokens_in(choice: dict) -> int:
    """How many generated tokens one streamed choice carries (0 for a bare finish chunk)."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    delta = choice.get("delta") or {}
    if "role" in delta and not delta.get("content"):
        return 0  # the chat stream's opening role chunk
    text = choice.get("text")
    if text is None:
        text = delta.get("content")
    return 1 if text or choice.get("finish_reason") is None else 0


async def _sse_lines(resp: aiohttp.ClientResponse):
    """The body's lines as bytes, each handed on as soon as its bytes have arrived."""
    pending = b""
    async for data in resp.content.iter_any():
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if pending:
        yield pending


class CompletionClient:
    """Sends planned requests to ``base_url`` over a shared ``aiohttp.ClientSession``.

    ``failover``, when given, stands for a load balancer in front of several entries: a connect
    to ``base_url`` that fails is handed to it (``EntryPicker.connect_failed``), and the request
    goes to the entry it names instead, within the same attempt; None from it lets the error
    through. Only connects are re-sent (the request never left)."""

    def __init__(self, http: aiohttp.ClientSession, base_url: str, *, model: str | None,
                 timeout_s: float, class_header: str = "x-kvguard-class",
                 clock: Callable[[], float] = time.monotonic,
                 failover: Callable[[str], str | None] | None = None) -> None:
        require_loopback(base_url)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._http = http
        self._base = base_url.rstrip("/")
        self._failover = failover
        self._model = model
        self._timeout_s = timeout_s
        self._class_header = class_header
        self._clock = clock

    async def send(self, spec: RequestSpec, body: bytes, t0_s: float) -> RequestRecord:
        """Send now; ``t0_s`` is the run start on this client's clock."""
        obs = Observation()
        start = self._clock()
        obs.sent_s = start - t0_s
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._exchange(spec, body, obs)
        except aiohttp.ClientError as exc:  # first: aiohttp's connect timeout is a
            obs.error = f"{type(exc).__name__}: {exc}"  # TimeoutError too, but not ours
        except TimeoutError:
            obs.canceled, obs.error = True, f"client timeout after {self._timeout_s:g}s"
        except asyncio.CancelledError:
            obs.canceled, obs.error = True, "canceled at drain deadline"
        except OSError as exc:
            obs.error = f"{type(exc).__name__}: {exc}"
        except ValueError as exc:  # malformed SSE JSON
            obs.error = f"bad stream chunk: {exc}"
        obs.end_s = self._clock()
        return observation_record(spec, obs, start)

    def _headers(self, spec: RequestSpec) -> dict[str, str]:
        headers = {"content-type": "application/json", "accept": "text/event-stream",
                   "authorization": f"Bearer {spec.tenant}",
                   self._class_header: spec.request_class}
        if spec.session_id is not None:
            headers["x-session-id"] = spec.session_id
        return headers

    async def _exchange(self, spec: RequestSpec, body: bytes, obs: Observation) -> None:
        async with await self._post(spec, body, obs) as resp:
            obs.status = resp.status
            obs.headers = {k.lower(): v for k, v in resp.headers.items()}
            if not 200 <= resp.status < 300:
                text = (await resp.read())[:_ERROR_BODY_BYTES].decode(errors="replace")
                obs.error = f"HTTP {resp.status}: {text}"
                return
            async for line in _sse_lines(resp):
                if self._on_line(line, obs):
                    break

    async def _post(self, spec: RequestSpec, body: bytes,
                    obs: Observation) -> aiohttp.ClientResponse:
        base, tried = self._base, set()
        while True:
            try:
                obs.entry = base
                return await self._http.post(base + "/v1/completions", data=body,
                                             headers=self._headers(spec))
            except aiohttp.ClientConnectorError:
                tried.add(base)
                nxt = self._failover(base) if self._failover is not None else None
                if nxt is None or nxt in tried:  # each entry is tried once per attempt
                    raise
                require_loopback(nxt)
                base = nxt

    def _on_line(self, line: bytes, obs: Observation) -> bool:
        """Handle one SSE line; True once ``[DONE]`` arrived."""
        if not line.startswith(b"data:"):
            return False
        payload = line[5:].strip()
        if payload == b"[DONE]":
            obs.saw_done = True
            return True
        chunk = json.loads(payload)
        if "error" in chunk:
            obs.error = f"stream error: {json.dumps(chunk['error'])[:_ERROR_BODY_BYTES]}"
        if chunk.get("usage"):
            obs.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            obs.finish_reason = choice.get("finish_reason") or obs.finish_reason
            obs.add_tokens(tokens_in(choice), self._clock())
        return False


def observation_record(spec: RequestSpec, obs: Observation, start: float) -> RequestRecord:
    """The frozen record of one attempt; ``start`` is its send time on the client's clock."""
    h = obs.headers
    if obs.status is not None and 200 <= obs.status < 300 and obs.error is None \
            and not obs.saw_done and not obs.canceled:
        obs.error = "stream ended without [DONE] (truncated)"
    return RequestRecord(
        index=spec.index, request_class=spec.request_class, tenant=spec.tenant,
        num_prompt_tokens=spec.num_prompt_tokens, max_tokens=spec.max_tokens,
        scheduled_s=spec.scheduled_s, sent_s=obs.sent_s,
        outcome=classify_outcome(obs.status, obs.error, obs.saw_done, obs.canceled),
        status=obs.status, error=obs.error,
        ttft_s=None if obs.first_token_s is None else obs.first_token_s - start,
        itl_s=tuple(obs.gaps_s), e2e_s=None if obs.end_s is None else obs.end_s - start,
        num_tokens_received=obs.num_tokens, usage=obs.usage,
        finish_reason=obs.finish_reason, saw_done=obs.saw_done,
        retry_after_s=_float_header(h, "retry-after"),
        retry_after_ms=_float_header(h, "retry-after-ms"),
        should_retry=h.get("x-should-retry"), reason=h.get("x-kvguard-reason"),
        queue_ms=_float_header(h, "x-kvguard-queue-ms"), request_id=h.get("x-request-id"),
        entry=obs.entry,
    )
