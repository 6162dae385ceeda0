"""``kvguard epp`` logs as the proxy does: ``--log-format json`` lines with a UTC timestamp (a
real child process), and ``--access-log`` one ``kvguard.access`` line per request."""

import asyncio
import json
import logging
import re
import socket
import sys
import time

import pytest

from chaos.child import ChildProcess
from guard.config import GuardConfig, ReplicaConfig
from guard.epp.server import EppServer

pytestmark = pytest.mark.slow

BODY = json.dumps({"model": "tiny", "prompt": "hello there", "max_tokens": 8}).encode()


def _dead_url() -> tuple[socket.socket, str]:
    """A replica nothing answers for (the socket is bound, never listened on)."""
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    return dead, f"http://127.0.0.1:{dead.getsockname()[1]}"


def test_json_log_lines_with_a_timestamp():
    dead, url = _dead_url()
    with dead:
        epp = ChildProcess("epp", lambda port: [
            sys.executable, "-m", "guard.cli", "epp", "--upstream", url, "--port", str(port),
            "--log-format", "json", "--log-level", "info"],
            lambda url: True, ready_pattern=r"kvguard epp listening on (\S+)")
        epp.start(90.0)
        try:
            deadline = time.monotonic() + 20.0
            lines = []
            while time.monotonic() < deadline and not lines:
                lines = [json.loads(x) for x in epp.output().splitlines()
                         if x.startswith("{") and "state unreadable" in x]
                time.sleep(0.1)
        finally:
            epp.terminate()
    assert lines, epp.output()
    line = lines[0]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["ts"])
    assert (line["level"], line["logger"]) == ("WARNING", "guard.replicas.poller")


def test_access_log_has_a_line_per_request(caplog):
    """No replica is routable: the request is shed (503) and logged as such."""
    dead, url = _dead_url()

    async def main():
        config = GuardConfig(replicas=(ReplicaConfig("r0", url, state_source="none"),))
        server = EppServer(config, access_log=True)
        server.health.is_ejected = lambda replica_id: True  # no routable replica
        server.controller.load_state.mark_unhealthy("r0", server.controller.clock())
        await server.controller.start()
        exchange = server.picker.exchange()
        exchange.on_request_headers({":method": "POST", ":path": "/v1/completions",
                                     "content-type": "application/json"})
        exchange.add_body(BODY)
        answer = await exchange.decide()
        await server.controller.aclose()
        return answer

    with dead, caplog.at_level(logging.INFO, logger="kvguard.access"):
        answer = asyncio.run(asyncio.wait_for(main(), 20))
    lines = [r for r in caplog.records if r.name == "kvguard.access"]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    fields = lines[0].fields
    assert (fields["decision"], fields["status"]) == ("shed", answer.status)
    assert fields["id"] == answer.request_id and fields["tenant"] == "anonymous"
