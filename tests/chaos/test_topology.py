"""The loopback fleet launcher: real sim replicas and a real redis-server, faults by signal."""

import os
import threading

import httpx
import pytest

from chaos.child import ChildProcess
from chaos.ports import ephemeral_range
from chaos.topology import Topology, TopologySpec, http_health, redis_health
from tests.support.fleet_cli import fleet_cli


@pytest.mark.parametrize("kwargs, message", [
    ({"num_replicas": -1}, "num_replicas"),
    ({"num_replicas": 0, "num_proxies": 1}, "num_proxies"),
    ({"replica_args": ("--model", "llama-7b", "--port", "9")}, "--port"),
    ({"proxy_args": ("--upstream", "http://x")}, "--upstream"),
    ({"start_timeout_s": 0}, "start_timeout_s"),
    ({"num_proxies": 1, "split": True}, "split"),   # the split config is Envoy's, for EPPs
])
def test_spec_rejects_what_it_cannot_start(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TopologySpec(**kwargs)


def test_the_health_check_reads_the_status_and_builds_no_http_client(monkeypatch):
    """200 is healthy; a 503, a refused connection or a server that closes at once are not.
    The fault driver polls this from the load generator's own process while a replica
    restarts, so it must not build a client (with its TLS context) per poll as httpx.get did."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/ok/health" else 503)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(httpx, "Client", None)  # any httpx client built here would now fail
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert http_health(base + "/ok") and http_health(base + "/ok/")
        assert not http_health(base + "/busy")
    finally:
        server.shutdown()
        server.server_close()
    assert not http_health(base + "/ok")  # refused now
    with pytest.raises(ValueError, match="http://host:port"):
        http_health("redis://127.0.0.1:6379")


def test_port_zero_needs_a_readiness_line():
    with pytest.raises(ValueError, match="ready_pattern"):
        ChildProcess("x", lambda port: ["true"], http_health)


def test_a_child_that_exits_early_is_reported_with_its_output():
    child = ChildProcess("early", lambda port: ["sh", "-c", "echo boom; exit 3"], http_health,
                         port=1)
    with pytest.raises(RuntimeError, match="exited with code 3(.|\n)*boom"):
        child.start(timeout_s=10)
    assert not child.alive


def test_a_start_racing_teardown_leaves_no_process_behind():
    """A fault's restart runs in a worker thread; Ctrl-C tears the fleet down meanwhile. The
    restarted process must not outlive the fleet (it once did), and no start follows close."""
    in_health, release = threading.Event(), threading.Event()

    def health(url):                     # the child is up, its start is waiting to be healthy
        in_health.set()
        release.wait(30)
        return False

    child = ChildProcess("slow", lambda port: ["sleep", "60"], health, port=1)
    errors = []

    def restart():
        try:
            child.restart(timeout_s=30)
        except RuntimeError as e:
            errors.append(str(e))

    worker = threading.Thread(target=restart)
    worker.start()
    assert in_health.wait(30)
    pid = child.pid
    child.close()                        # teardown, while the start is under way
    release.set()
    worker.join(30)
    assert errors and "closed while starting" in errors[0]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="closed"):
        child.start(timeout_s=5)         # nothing starts after teardown
    assert not child.alive


@pytest.mark.slow
def test_fleet_starts_healthy_and_faults_act_on_one_pid():
    spec = TopologySpec(num_replicas=2, redis=True)
    with Topology(spec) as fleet:
        pids = [r.pid for r in fleet.replicas] + [fleet.redis.pid]
        assert len(set(fleet.replica_urls)) == 2
        assert all(http_health(url) for url in fleet.replica_urls)
        assert redis_health(fleet.redis_url)
        # below the ephemeral range: no outgoing connection can take a killed child's port
        assert all(c.port < ephemeral_range()[0] for c in [*fleet.replicas, fleet.redis])

        victim, survivor = fleet.replicas
        url = victim.url
        victim.kill()
        assert not victim.alive and not http_health(url)
        assert survivor.alive and http_health(survivor.url)

        victim.restart(timeout_s=60)
        assert victim.url == url and victim.num_starts == 2 and http_health(url)

        victim.stop()
        with pytest.raises(httpx.TimeoutException):
            httpx.get(url + "/health", timeout=0.5, trust_env=False)
        victim.cont()
        assert http_health(url)
        victim.stop()  # left stopped: teardown must still end it
        live = [victim.pid, survivor.pid, fleet.redis.pid]
    for pid in pids[1:] + live:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not any(c.alive for c in fleet.replicas)


@pytest.mark.slow
def test_a_failed_start_ends_what_was_already_started():
    spec = TopologySpec(num_replicas=2, replica_args=("--model", "no-such-model", "--backend",
                                                      "sim"), redis=True, start_timeout_s=60)
    fleet = Topology(spec)
    with pytest.raises(RuntimeError, match="replica-0"):
        with fleet:
            pytest.fail("a fleet whose replica cannot start must not enter its block")
    assert fleet.redis is not None and fleet.redis.num_starts == 1
    assert not fleet.redis.alive and not any(replica.alive for replica in fleet.replicas)


@pytest.mark.slow
def test_kvguard_fleet_prints_urls_and_stops_everything_on_sigint():
    import signal

    with fleet_cli("--replicas", "2", "--proxies", "1") as (proc, lines):
        names = [fields[0] for fields in lines]
        assert names == ["replica-0", "replica-1", "proxy-0"], lines
        assert http_health(lines[2][1])
        models = httpx.get(lines[2][1] + "/v1/models", timeout=10, trust_env=False).json()
        assert [m["id"] for m in models["data"]] == ["llama-7b"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        for fields in lines:
            with pytest.raises(ProcessLookupError):
                os.kill(int(fields[3]), 0)


def _exec_done(pid: int, name: str):
    """The process ``pid`` once a wrapper (``nice``, ``taskset``) has exec'd ``name`` in it
    (polled up to ~1 s; asserted)."""
    import psutil

    proc = psutil.Process(pid)
    for _ in range(100):
        if proc.name() == name:
            break
        threading.Event().wait(0.01)
    assert proc.name() == name
    return proc


def test_a_child_started_nicer_runs_at_that_niceness_under_its_own_pid():
    """The fleet runs below the load generator that times it (``niceness``): the process the
    pid names is the command itself (``nice`` execs it), so kills by pid still reach it."""
    health_seen = []

    def health(url):
        health_seen.append(url)
        return True

    child = ChildProcess("nice", lambda port: ["sleep", "60"], health, port=1, niceness=5)
    try:
        child.start(timeout_s=10)
        proc = _exec_done(child.pid, "sleep")  # `nice` execs `sleep` right after the fork
        assert proc.nice() == min(19, os.nice(0) + 5)
    finally:
        child.close()
    assert not child.alive
    with pytest.raises(ValueError, match="niceness"):
        ChildProcess("x", lambda port: ["true"], health, port=1, niceness=-1)


def test_a_child_started_on_cpus_runs_only_there_under_its_own_pid():
    """``cpus``: the command runs on those CPUs only (``taskset`` execs it, so the pid is the
    command's and every thread it starts inherits them), whatever this process runs on."""
    cpu = max(os.sched_getaffinity(0))
    child = ChildProcess("pinned", lambda port: ["sleep", "60"], lambda url: True, port=1,
                         cpus=[cpu])
    try:
        child.start(timeout_s=10)
        _exec_done(child.pid, "sleep")  # `taskset` execs `sleep` right after the fork
        assert os.sched_getaffinity(child.pid) == {cpu}
    finally:
        child.close()
    with pytest.raises(ValueError, match="cpus"):
        ChildProcess("x", lambda port: ["true"], lambda url: True, port=1, cpus=[-1])
