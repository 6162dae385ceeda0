"""Real processes on loopback for the proxy tests: sim replicas, misbehaving upstreams, proxies."""

import contextlib
import sys
from pathlib import Path

import httpx

from chaos.child import ChildProcess
from chaos.topology import http_health

UPSTREAM = Path(__file__).with_name("upstream_server.py")
# The proxy tests run on kvguard's own HTTP server (``--http kvguard``); the slow-client, drain
# and pass-through tests also run on uvicorn (``UVICORN``), which ``--http auto`` picks.
HTTP_SERVER = "kvguard"
UVICORN = "auto"
HTTP_SERVERS = (HTTP_SERVER, UVICORN)

# Small timeouts so failures show quickly; the assertions use wide multiples of them.
PROXY_CONFIG = """
policy = "{policy}"
refresh_interval_s = 0.1
state_timeout_s = 0.5
unhealthy_after_errors = 2
[proxy]
connect_timeout_s = 0.5
read_timeout_s = {read_timeout_s}
eject_after_failures = 2
probe_interval_s = {probe_interval_s}
drain_timeout_s = 20.0
upstream_client = "{client}"
"""


def write_config(directory: Path, *, policy: str = "slo", read_timeout_s: float = 2.0,
                 client: str = "h1", probe_interval_s: float = 0.2) -> str:
    path = directory / f"proxy-{policy}-{client}.toml"
    path.write_text(PROXY_CONFIG.format(policy=policy, read_timeout_s=read_timeout_s,
                                        client=client, probe_interval_s=probe_interval_s))
    return str(path)


@contextlib.contextmanager
def running(child: ChildProcess, timeout_s: float = 90.0):
    child.start(timeout_s)
    try:
        yield child
    finally:
        child.terminate()


def proxy_child(upstreams: list[str], config: str, *, state_source: str = "kvguard",
                healthy: bool = True, extra_args: tuple[str, ...] = (),
                http: str = HTTP_SERVER) -> ChildProcess:
    """``kvguard proxy`` for these upstreams (none: the config's ``[[replicas]]``) on the
    ``http`` server; ``healthy=False`` waits only for the port."""
    args = [a for url in upstreams for a in ("--upstream", url)] + list(extra_args)
    args += ["--http", http]

    def argv(port: int) -> list[str]:
        return [sys.executable, "-m", "guard.cli", "proxy", *args, "--state-source",
                state_source, "--config", config, "--host", "127.0.0.1", "--port", str(port)]

    health = http_health if healthy else _answers
    return ChildProcess("proxy", argv, health, ready_pattern=r"kvguard proxy listening on (\S+)")


def upstream_child(mode: str, model: str = "fake-model",
                   max_model_len: int | None = None) -> ChildProcess:
    """``upstream_server.py`` in ``mode`` serving ``model`` (listed with ``max_model_len``)."""
    extra = [] if max_model_len is None else [str(max_model_len)]
    return ChildProcess(f"upstream-{mode}", lambda port: [sys.executable, str(UPSTREAM), mode,
                                                          model, *extra],
                        http_health, ready_pattern=r"upstream listening on (\S+)")


def _answers(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2.0, trust_env=False)
        return True
    except httpx.HTTPError:
        return False


def sse_lines(response: httpx.Response) -> list[str]:
    return [line for line in response.iter_lines() if line.startswith("data: ")]
