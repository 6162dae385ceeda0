"""A tiny OpenAI-shaped SSE echo server for load-generator tests.

Run as ``python echo_server.py PORT``. ``POST /v1/completions`` streams ``max_tokens`` fake
token chunks, a usage chunk, then ``data: [DONE]``. The tenant picks a behaviour:
A body that is not what ``kvguard load`` must send (token-id prompt, ``stream``, ``ignore_eos``,
``include_usage``) gets a 400. ``chaos-tenant-1`` gets a 503 with the guard's retry headers, ``chaos-tenant-2`` a stream cut
before ``[DONE]``; class ``slow`` sleeps 0.1 s per token. ``GET /metrics`` counts requests.

Retry behaviours for the chaos clients (attempts counted per tenant and prompt):
``chaos-tenant-3`` 503 + ``retry-after-ms: 100`` + ``x-should-retry: true`` on the first two
attempts, then the stream; ``chaos-tenant-4`` 429 + ``x-should-retry: false``;
``chaos-tenant-5`` 503 + ``retry-after: 200`` (past the SDK's 120 s cap); ``chaos-tenant-6``
never answers (hangs 60 s); ``chaos-tenant-7`` a bare 503 (no retry headers);
``chaos-tenant-8`` an SSE error event after two tokens; ``chaos-tenant-9`` 503 +
``retry-after: 100`` (the SDK waits it out); ``chaos-tenant-20`` the whole stream, its end
0.5 s after ``[DONE]``. ``GET /attempts`` returns the counts
and the last ``x-stainless-retry-count`` seen per tenant.
"""

import asyncio
import json
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

COUNTS = {"requests": 0}
ATTEMPTS: dict[str, int] = {}
RETRY_COUNT_HEADER: dict[str, str] = {}
REJECT_HEADERS = {"retry-after": "2", "retry-after-ms": "1500", "x-should-retry": "true",
                  "x-kvguard-reason": "overloaded"}


def _check(body: dict) -> str | None:
    """What the load generator must always send: token-id prompts, streaming with usage."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not all(1000 <= t < 20000 for t in prompt):
        return "prompt must be a list of token ids in [1000, 20000)"
    if body.get("stream") is not True or body.get("ignore_eos") is not True:
        return "stream and ignore_eos must be true"
    if body.get("stream_options") != {"include_usage": True}:
        return "stream_options.include_usage must be true"
    return None


async def completions(request: Request):
    body = await request.json()
    COUNTS["requests"] += 1
    problem = _check(body)
    if problem:
        return JSONResponse({"error": {"message": problem}}, status_code=400)
    tenant = request.headers.get("authorization", "")
    special = await _retry_behaviour(tenant, body, request.headers)
    if special is not None:
        return special
    if tenant.endswith("chaos-tenant-1"):
        return JSONResponse({"error": {"message": "overloaded"}}, status_code=503,
                            headers=REJECT_HEADERS)
    n = int(body.get("max_tokens", 4))
    num_prompt = len(body.get("prompt", []))
    delay_s = 0.1 if request.headers.get("x-kvguard-class") == "slow" else 0.0
    cut = tenant.endswith("chaos-tenant-2")
    stream_error = tenant.endswith("chaos-tenant-8")
    late_end = tenant.endswith("chaos-tenant-20")

    async def events():
        for i in range(n):
            if delay_s:
                await asyncio.sleep(delay_s)
            reason = "length" if i == n - 1 else None
            chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": reason}]}
            yield f"data: {json.dumps(chunk)}\n\n"
            if cut and i == 1:
                return
            if stream_error and i == 1:
                yield 'data: {"error": {"message": "upstream died", "type": "upstream_failed"}}\n\n'
                return
        usage = {"prompt_tokens": num_prompt, "completion_tokens": n,
                 "total_tokens": num_prompt + n}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
        if late_end:  # the response's end follows [DONE] later than the SDK drains for
            await asyncio.sleep(0.5)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"x-kvguard-queue-ms": "1.5"})


async def _retry_behaviour(tenant: str, body: dict, headers) -> JSONResponse | None:
    name = tenant.removeprefix("Bearer ")
    key = f"{name}:{hash(tuple(body.get('prompt') or ()))}"
    ATTEMPTS[key] = ATTEMPTS.get(key, 0) + 1
    ATTEMPTS[name] = ATTEMPTS.get(name, 0) + 1
    RETRY_COUNT_HEADER[name] = headers.get("x-stainless-retry-count", "-")
    error = {"error": {"message": "shed", "type": "overloaded"}}
    if name == "chaos-tenant-3" and ATTEMPTS[key] <= 2:
        return JSONResponse(error, status_code=503, headers={
            "retry-after-ms": "100", "retry-after": "1", "x-should-retry": "true"})
    if name == "chaos-tenant-4":
        return JSONResponse(error, status_code=429, headers={"x-should-retry": "false"})
    if name == "chaos-tenant-5":
        return JSONResponse(error, status_code=503, headers={"retry-after": "200"})
    if name == "chaos-tenant-6":
        await asyncio.sleep(60)
    if name == "chaos-tenant-9":
        return JSONResponse(error, status_code=503, headers={"retry-after": "100"})
    if name == "chaos-tenant-7":
        return JSONResponse(error, status_code=503)
    return None


async def attempts(request: Request):
    return JSONResponse({"attempts": ATTEMPTS, "retry_count_header": RETRY_COUNT_HEADER})


async def metrics(request: Request):
    return PlainTextResponse(f"echo_requests_total {COUNTS['requests']}\n")


app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                        Route("/metrics", metrics), Route("/attempts", attempts)])

if __name__ == "__main__":
    # A hung request (chaos-tenant-6) may still be open when the test ends it: stop within 1 s.
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
                access_log=False, timeout_graceful_shutdown=1)
