"""The middleware prices the path the wrapped app routes on, and refuses a target that reads
as an admitted path in more than one way (the same function as the proxy's,
guard.request.target), on uvicorn h11, uvicorn httptools and kvguard's own server, over real
HTTP on loopback."""

import json
import random
import socket

import pytest

from tests.support.admission import make_guard
from tests.support.loopback import serve_on

BODY = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4}).encode()


class RoutedApp:
    """Answers 200 and records the (path, raw_path) of each request it is handed."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bytes]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        self.seen.append((scope["path"], scope["raw_path"]))
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body",
                    "body": b'{"usage": {"prompt_tokens": 1, "completion_tokens": 1}}'})


def post(url: str, target: bytes) -> int:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(b"POST " + target + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                     b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(BODY) + BODY)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return int(answer[9:12]) if answer.startswith(b"HTTP/1.1 ") else 0


@pytest.mark.parametrize("server", ["h11", "httptools", "kvguard"])
def test_the_middleware_refuses_hidden_separators_and_never_answers_500(server):
    app = RoutedApp()
    guard = make_guard(app)
    with serve_on(guard, server) as running:
        assert post(running.url, b"/v1/completions") == 200
        for target in (b"/v1/completions%3F/v1/chat/completions",
                       b"/v1/completions%23/v1/chat/completions", b"/x%2Fv1/completions",
                       b"/v1/chat/completions/../../completions"):
            assert post(running.url, target) == 400, target
        assert app.seen == [("/v1/completions", b"/v1/completions")]
        # each refusal is an outcome like any other: offered and rejected, by its reason
        rejected = guard.controller.registry.get_sample_value(
            "kvguard_requests_rejected_total",
            {"class": "interactive", "tenant": "anonymous", "reason": "invalid_request_target"})
        assert rejected == 4
        rng = random.Random(7)
        pieces = [b"/", b"v1", b"completions", b"%2F", b"%3F", b"%E2%82%AC", b"..", b"%zz",
                  b"\xff", b"%00", b"?", b"#"]
        for _ in range(40):
            target = b"/" + b"".join(rng.choice(pieces) for _ in range(rng.randrange(1, 6)))
            assert post(running.url, target + b"/v1/completions") in (0, 200, 400), target
    assert guard.controller.tickets.num_held == 0
