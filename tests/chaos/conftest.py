"""Fixtures for chaos tests: a real SSE echo server on a free loopback port."""

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from chaos.ports import free_port

ECHO = Path(__file__).with_name("echo_server.py")


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up in {timeout_s} s")


@pytest.fixture(scope="module")
def echo_url():
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ECHO), str(port)])
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/metrics", proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
