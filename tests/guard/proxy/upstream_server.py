"""A misbehaving OpenAI-shaped upstream for proxy tests (stdlib asyncio, raw HTTP/1.1).

Run as ``python upstream_server.py MODE MODEL [MAX_MODEL_LEN]``; it prints ``upstream listening on
http://127.0.0.1:PORT``. ``GET /health`` is 200 and ``GET /v1/models`` lists MODEL in every
mode (with ``max_model_len`` when given, as vLLM lists it); ``GET /count`` is the number of POSTs received; ``GET /connections`` lists, per accepted
connection, the ``METHOD PATH`` of every request it carried (``/connections`` itself left out);
``GET /version`` and ``GET /v1/models/MODEL`` answer as vLLM does, ``POST /tokenize`` with
the prompt's characters as tokens and the headers it received;
``GET /metrics`` is vLLM's gauges with a ``cache_config_info`` that lacks ``num_gpu_blocks``
(a vLLM whose KV capacity the guard cannot read).
A POST gets, by MODE:

* ``ok``: a JSON completion with usage (or, with ``"stream": true``, three SSE chunks and
  ``[DONE]``);
* ``echo``: as ``ok``, and a JSON completion carries ``received``: the request's body and
  headers as this upstream read them;
* ``status500``: HTTP 500;
* ``status503``: HTTP 503 with ``retry-after: 7`` (an engine over its connection cap);
* ``big``: a stream of ``BIG_EVENTS`` ~4 KB events (numbered) and ``[DONE]``, written as fast
  as the reader takes them;
* ``garbage``: bytes that are not HTTP, then the connection closes;
* ``slow``: a stream of one event every ``SLOW_GAP_S`` for ``SLOW_EVENTS`` events, then
  ``[DONE]`` (a stream still running when a drain deadline passes);
* ``hang``: reads the request and never answers (the connection stays open);
* ``cut``: a ``/v1/responses`` stream sends its text deltas and ends the body without its
  ``response.completed`` event (other POSTs as ``ok``).

``POST /v1/responses`` answers as vLLM's Responses API does (``ok``, ``echo``, ``cut``): a
``response`` object with ``usage.input_tokens``/``output_tokens``, or with ``"stream": true``
typed events (``event: TYPE`` + ``data: {"type": TYPE, ...}``) ending with
``response.completed`` and no ``[DONE]``. ``POST /v1/embeddings`` answers an embedding list
with ``usage.prompt_tokens``.
"""

import asyncio
import json
import sys

COUNT = {"posts": 0}
MAX_MODEL_LEN: dict[str, int | None] = {"value": None}  # listed in /v1/models when given
CONNECTIONS: list[list[str]] = []  # per accepted connection: "METHOD PATH" of each request
BIG_EVENTS = 4000  # mode "big": ~16 MB of stream, more than loopback socket buffers hold
SLOW_EVENTS, SLOW_GAP_S = 1200, 0.05  # mode "slow": a minute of stream
VLLM_METRICS_WITHOUT_BLOCKS = (
    b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"
    b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0.0\n"
    b"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.0\n"
    b'# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="16"} 1.0\n')


def _response(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + content_type +
            b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes, dict]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", 0))
    body = await reader.readexactly(length) if length else b""
    return method, path, body, headers


async def _post(mode: str, model: str, body: bytes, writer: asyncio.StreamWriter,
                headers: dict, path: str = "") -> bool:
    """Answer one POST; False when the connection must close."""
    COUNT["posts"] += 1
    if path == "/tokenize":  # vLLM's shape, and what this upstream saw
        tokens = list(range(len(json.loads(body or b"{}").get("prompt", ""))))
        answer = {"tokens": tokens, "count": len(tokens), "max_model_len": 4096,
                  "received_headers": headers}
        writer.write(_response("200 OK", json.dumps(answer).encode()))
        return True
    if mode == "status500":
        writer.write(_response("500 Internal Server Error", b'{"error": "boom"}'))
        return True
    if mode == "status503":
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 7\r\n"
                     b"content-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
        return True
    if mode == "garbage":
        writer.write(b"\x00\x01 this is not HTTP at all \r\n\r\n")
        return False
    request = json.loads(body or b"{}")
    if path == "/v1/responses" and mode in ("ok", "echo", "cut"):
        return await _responses(mode, model, request, headers, writer)
    if path == "/v1/embeddings" and mode in ("ok", "echo"):
        inputs = request.get("input")
        inputs = inputs if isinstance(inputs, list) else [inputs]
        payload = {"object": "list", "model": model,
                   "data": [{"object": "embedding", "index": i, "embedding": [0.5, -0.5]}
                            for i in range(len(inputs))],
                   "usage": {"prompt_tokens": 7, "total_tokens": 7}}
        if mode == "echo":
            payload["received"] = {"body": request, "headers": headers}
        writer.write(_response("200 OK", json.dumps(payload).encode()))
        return True
    if mode == "big":  # a long stream, written as fast as the proxy takes it
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for i in range(BIG_EVENTS):
            data = b'data: {"choices": [{"index": 0, "text": "%08d%s"}]}\n\n' % (i, b"x" * 4000)
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
        writer.write(b"%x\r\ndata: [DONE]\n\n\r\n0\r\n\r\n" % len(b"data: [DONE]\n\n"))
        return True
    if mode == "hang":
        await asyncio.sleep(3600)
    if mode == "slow":
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for i in range(SLOW_EVENTS):
            data = b'data: {"choices": [{"index": 0, "text": " %d"}]}\n\n' % i
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
            await asyncio.sleep(SLOW_GAP_S)
        writer.write(b"%x\r\ndata: [DONE]\n\n\r\n0\r\n\r\n" % len(b"data: [DONE]\n\n"))
        return True
    if not request.get("stream"):
        payload = {"id": "x", "object": "text_completion", "model": model,
                   "choices": [{"index": 0, "text": "a b c", "finish_reason": "length"}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}
        if mode == "echo":
            payload["received"] = {"body": request, "headers": headers}
        writer.write(_response("200 OK", json.dumps(payload).encode()))
        return True
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                 b"transfer-encoding: chunked\r\n\r\n")
    events = [json.dumps({"choices": [{"index": 0, "text": t}]}) for t in ("a", " b", " c")]
    for event in [*events, "[DONE]"]:
        data = f"data: {event}\n\n".encode()
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()
    writer.write(b"0\r\n\r\n")
    return True


RESPONSE_TEXT = ("a", " b", " c")


def _response_object(model: str, status: str, text: str, usage: dict | None) -> dict:
    message = {"id": "msg_1", "type": "message", "role": "assistant", "status": status,
               "content": [{"type": "output_text", "text": text, "annotations": []}]}
    return {"id": "resp_1", "object": "response", "created_at": 0, "model": model,
            "status": status, "output": [message] if text else [], "usage": usage,
            "incomplete_details": None, "error": None}


async def _responses(mode: str, model: str, request: dict, headers: dict,
                     writer: asyncio.StreamWriter) -> bool:
    usage = {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": len(RESPONSE_TEXT), "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": 5 + len(RESPONSE_TEXT)}
    text = "".join(RESPONSE_TEXT)
    if not request.get("stream"):
        payload = _response_object(model, "completed", text, usage)
        if mode == "echo":
            payload["received"] = {"body": request, "headers": headers}
        writer.write(_response("200 OK", json.dumps(payload).encode()))
        return True
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                 b"transfer-encoding: chunked\r\n\r\n")
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "in_progress",
            "content": []}
    part = {"type": "output_text", "text": "", "annotations": []}
    at = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    events = [("response.created", {"response": _response_object(model, "in_progress", "", None)}),
              ("response.in_progress",
               {"response": _response_object(model, "in_progress", "", None)}),
              ("response.output_item.added", {"output_index": 0, "item": item}),
              ("response.content_part.added", {**at, "part": part})]
    events += [("response.output_text.delta", {**at, "delta": t}) for t in RESPONSE_TEXT]
    if mode != "cut":
        events += [("response.output_text.done", {**at, "text": text}),
                   ("response.content_part.done", {**at, "part": {**part, "text": text}}),
                   ("response.output_item.done", {"output_index": 0, "item": {
                       **item, "status": "completed", "content": [{**part, "text": text}]}}),
                   ("response.completed",
                    {"response": _response_object(model, "completed", text, usage)})]
    for number, (kind, fields) in enumerate(events):
        data = f"event: {kind}\ndata: " + json.dumps(
            {"type": kind, "sequence_number": number, **fields}) + "\n\n"
        data = data.encode()
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()
    writer.write(b"0\r\n\r\n")
    return True


async def _serve(mode: str, model: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
    carried: list[str] = []
    CONNECTIONS.append(carried)
    try:
        while True:
            method, path, body, headers = await _read_request(reader)
            if path != "/connections":
                carried.append(f"{method} {path}")
            if method == "POST":
                keep = await _post(mode, model, body, writer, headers, path)
            elif path == "/v1/models":
                entry = {"id": model, "object": "model"}
                if MAX_MODEL_LEN["value"] is not None:
                    entry["max_model_len"] = MAX_MODEL_LEN["value"]
                models = {"object": "list", "data": [entry]}
                writer.write(_response("200 OK", json.dumps(models).encode()))
                keep = True
            elif path == "/connections":
                listed = [c for c in CONNECTIONS if c]
                writer.write(_response("200 OK", json.dumps(listed).encode()))
                keep = True
            elif path == "/metrics":
                writer.write(_response("200 OK", VLLM_METRICS_WITHOUT_BLOCKS, b"text/plain"))
                keep = True
            elif path == "/version":
                writer.write(_response("200 OK", b'{"version": "scripted-0.1"}'))
                keep = True
            elif path == f"/v1/models/{model}":
                writer.write(_response("200 OK", json.dumps(
                    {"id": model, "object": "model"}).encode()))
                keep = True
            elif path == "/count":
                writer.write(_response("200 OK", json.dumps(COUNT).encode()))
                keep = True
            elif path == "/health":
                writer.write(_response("200 OK", b'{"status": "ok"}'))
                keep = True
            else:
                writer.write(_response("404 Not Found", b'{"error": "not found"}'))
                keep = True
            await writer.drain()
            if not keep:
                break
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def main(mode: str, model: str) -> None:
    server = await asyncio.start_server(lambda r, w: _serve(mode, model, r, w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    print(f"upstream listening on http://127.0.0.1:{port}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) > 3:
        MAX_MODEL_LEN["value"] = int(sys.argv[3])
    asyncio.run(main(sys.argv[1], sys.argv[2]))
