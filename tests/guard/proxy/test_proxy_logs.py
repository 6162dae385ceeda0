"""Operable logs, real processes over loopback: ``--log-format json`` lines with timestamps,
``--access-log`` one line per request (admitted or refused) with its fields, none without it."""

import json
import re
import socket
import time

import pytest
from proxy_helpers import proxy_child, running, upstream_child, write_config

pytestmark = pytest.mark.slow

MODEL = "m"


def _json_lines(output: str) -> list[dict]:
    lines = []
    for line in output.splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


def _until(check, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (value := check()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def test_json_access_log_has_one_line_per_request(tmp_path, client):
    with running(upstream_child("ok", MODEL)) as upstream, running(proxy_child(
            [upstream.url], write_config(tmp_path), state_source="none",
            extra_args=("--access-log", "--log-format", "json"))) as proxy:
        ok = client.post(proxy.url + "/v1/completions",
                         json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert ok.status_code == 200
        missing = client.post(proxy.url + "/v1/completions",
                              json={"model": "nope", "prompt": "hi", "max_tokens": 3})
        assert missing.status_code == 404

        def access():
            found = [line for line in _json_lines(proxy.output())
                     if line.get("logger") == "kvguard.access"]
            return found if len(found) >= 2 else None

        lines = _until(access)
    assert lines, proxy.output()
    served, refused = lines
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", served["ts"])
    assert served["level"] == "INFO" and served["message"] == "request"
    assert served["id"] == ok.headers["x-kvguard-request-id"]
    assert (served["tenant"], served["model"], served["replica"], served["decision"],
            served["status"], served["outcome"]) == ("anonymous", MODEL, "r0", "admit", 200,
                                                     "completed")
    assert served["output_tokens"] == 3 and served["prompt_tokens"] >= 1
    assert 0 <= served["ttft_ms"] <= served["duration_ms"]
    assert (refused["id"], refused["status"], refused["decision"], refused["reason"]) == (
        missing.headers["x-kvguard-request-id"], 404, "shed", "model_not_found")


def test_text_logs_carry_a_timestamp_and_no_access_lines_unless_asked(tmp_path, client):
    with socket.socket() as dead:  # a replica nothing answers for: its state is unreadable
        dead.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{dead.getsockname()[1]}"
        with running(proxy_child([url], write_config(tmp_path), healthy=False,
                                 extra_args=("--log-level", "info"))) as proxy:
            line = _until(lambda: next((x for x in proxy.output().splitlines()
                                        if "state unreadable" in x), None))
    assert line and re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z WARNING "
                             r"guard\.replicas\.poller: replica r0: state unreadable: ", line)
    assert "kvguard.access" not in proxy.output()
