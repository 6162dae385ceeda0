"""A guard process for the multi-guard budget tests: a small completion app wrapped in
AdmissionMiddleware (config from ``KVGUARD_CONFIG``), served by uvicorn on 127.0.0.1:PORT.

Each completion holds for ``HOLD_S`` seconds (so the test has many requests in flight at once)
and reports ``usage`` of 10 prompt + 5 completion tokens.
"""

from __future__ import annotations

import asyncio
import json
import sys

import uvicorn

from guard.middleware import AdmissionMiddleware

USAGE = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


def completion_app(hold_s: float):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["method"] != "POST":  # no /kvguard/state: a replica of unknown capacity
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        if True:
            await asyncio.sleep(hold_s)
            body = json.dumps({"id": "c", "object": "text_completion", "model": "m",
                               "choices": [{"index": 0, "text": " hi", "finish_reason": "stop"}],
                               "usage": USAGE}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
    return app


if __name__ == "__main__":
    port, hold_s = int(sys.argv[1]), float(sys.argv[2])
    uvicorn.run(AdmissionMiddleware(completion_app(hold_s)), host="127.0.0.1", port=port,
                log_level="warning", lifespan="off")
