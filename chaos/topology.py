"""A fleet on loopback: N sim engine replicas, M kvguard proxies, optionally a redis-server.

    spec = TopologySpec(num_replicas=2, num_proxies=1)
    with Topology(spec) as fleet:
        fleet.proxy_urls          # ["http://127.0.0.1:PORT"]
        fleet.replicas[0].kill()  # fault injection: kill / stop / cont / restart (chaos.child)

Every process is a child of this one, on a free loopback port, health-checked before
``with Topology(spec)`` enters its block: replicas answer ``GET /health`` 200; proxies answer
``GET /health`` 200 (at least one replica routable); redis answers ``PING``. On leaving the
block (normally, on an exception, or on Ctrl-C) the proxies are ended first, then the replicas,
then redis, each by its own pid (SIGTERM, SIGKILL after a timeout). Redis and the replicas start
at the same time, then the proxies; the children of one kind are ended at the same time too.
Processes of a topology that failed to start are ended the same way before the error propagates.

Replicas run ``kvguard engine <replica_args> --host 127.0.0.1 --port P``; proxies run
``kvguard proxy --upstream URL ... <proxy_args> --host 127.0.0.1 --port P``; with
``redis=True`` a ``redis-server`` runs with no persistence and each proxy gets its URL in
``KVGUARD_REDIS_URL``. A restarted child comes back on the same port, so the proxies'
upstream URLs (and the clients' proxy URLs) stay valid. Every ``P`` is chosen below the
kernel's ephemeral range (:mod:`chaos.ports`), so that no outgoing connection can take a
killed child's port before it starts again.
"""

from __future__ import annotations

import contextlib
import http.client
import shutil
import socket
import sys
import tempfile
import threading
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from chaos.child import ChildProcess
from chaos.ports import free_port

__all__ = ["Topology", "TopologySpec", "SIM_REPLICA_ARGS", "FLEET_NICENESS", "free_port",
           "http_health", "redis_health"]

SIM_REPLICA_ARGS = ("--model", "llama-7b", "--backend", "sim")
# What the chaos runs and the fleet bake-off start their fleets at (``TopologySpec.niceness``):
# on a small machine the load generator timing every token is served first, and the fleet under
# test takes the CPU contention (quick redis-kill runs, 2 cores, at equal priority: a ~0.2 s gap
# in every in-flight stream at once in 3 of 10 policy runs, the generator's sends up to 0.2 s
# late then; none in 5 runs at this niceness).
FLEET_NICENESS = 5
_ENGINE_READY = r"kvguard engine listening on (http://\S+)"
_PROXY_READY = r"kvguard proxy listening on (http://\S+)"


@dataclass(frozen=True)
class TopologySpec:
    """What to start. ``replica_args`` go to every ``kvguard engine`` (``{replica}`` in one
    becomes the replica's index), ``proxy_args`` to every
    ``kvguard proxy`` (e.g. ``("--config", "guard.toml")``). ``niceness`` > 0 starts every child
    under ``nice -n``: on a machine the fleet shares with the load generator that times it, the
    instrument is served first and the fleet absorbs the CPU contention."""

    num_replicas: int = 2
    replica_args: tuple[str, ...] = SIM_REPLICA_ARGS
    num_proxies: int = 0
    proxy_args: tuple[str, ...] = ()
    # > 0: one Envoy in front (deploy/envoy/envoy.yaml) with this many `kvguard epp` as its
    # endpoint pickers (proxy_args go to them: `kvguard epp` flags), in place of proxies
    num_epps: int = 0
    # with num_epps: Envoy on deploy/envoy/envoy-split.yaml (the response reported by an
    # observer filter; each EPP gets --epp-id and a route back to it) instead of envoy.yaml
    split: bool = False
    # one Envoy as the clients' entry balancer in front of the proxies (chaos.envoy_entry)
    entry_envoy: bool = False
    redis: bool = False
    start_timeout_s: float = 90.0
    env: Mapping[str, str] = field(default_factory=dict)
    niceness: int = 0

    def __post_init__(self) -> None:
        for name in ("num_replicas", "num_proxies", "num_epps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be an integer >= 0, got {value!r}")
        if self.num_proxies and not self.num_replicas:
            raise ValueError("num_proxies: a proxy needs at least one replica (num_replicas >= 1)")
        if self.num_epps and (self.num_proxies or not self.num_replicas):
            raise ValueError("num_epps: Envoy + EPPs front the replicas in place of proxies "
                             "(num_proxies = 0, num_replicas >= 1)")
        if self.split and not self.num_epps:
            raise ValueError("split: the split Envoy config fronts kvguard epp (num_epps >= 1)")
        if self.entry_envoy and not self.num_proxies:
            raise ValueError("entry_envoy: the entry Envoy balances kvguard proxies "
                             "(num_proxies >= 1)")
        if not self.start_timeout_s > 0:
            raise ValueError(f"start_timeout_s: must be > 0, got {self.start_timeout_s!r}")
        for name in ("--host", "--port", "--upstream"):
            if name in self.replica_args or name in self.proxy_args:
                raise ValueError(f"{name}: the topology sets it; leave it out of the args")
        if self.redis and shutil.which("redis-server") is None:
            raise ValueError("redis: redis-server is not on PATH")


def http_health(url: str, timeout_s: float = 2.0) -> bool:
    """``GET url/health`` answered 200 within ``timeout_s``.

    One plain ``http.client`` GET: the fault driver polls this from a thread of the load
    generator's process while a restarted replica comes up, and a throwaway ``httpx`` client
    builds a TLS context each time (over a hundred times this GET's CPU), CPU the generator's
    event loop then lacks while it times the streams in flight."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise ValueError(f"http_health: need an http://host:port URL, got {url!r}")
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
    try:
        conn.request("GET", parts.path.rstrip("/") + "/health")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def redis_health(url: str) -> bool:
    """The redis at ``url`` answered ``PING`` with ``+PONG``."""
    host, port = url.removeprefix("redis://").split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class Topology:
    """The running fleet: ``replicas``, ``proxies``, ``epps`` and ``redis`` (a
    :class:`ChildProcess` each, ``redis`` None unless requested), ``envoy`` in front of the
    EPPs when there are any, or of the proxies with ``spec.entry_envoy`` (its admin page at
    ``envoy_admin_url`` either way). ``with Topology(spec) as fleet:`` starts it."""

    def __init__(self, spec: TopologySpec | None = None) -> None:
        self.spec = spec or TopologySpec()
        self.replicas: list[ChildProcess] = []
        self.proxies: list[ChildProcess] = []
        self.epps: list[ChildProcess] = []
        self.envoy: ChildProcess | None = None
        self.envoy_admin_url: str | None = None
        self.redis: ChildProcess | None = None
        self._envoy_dir: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> Topology:
        """Start everything (ending what started if anything fails); the fleet is ready."""
        try:
            self._start_all()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _start_all(self) -> None:
        spec = self.spec
        if spec.num_proxies:
            from guard.cli import SUBCOMMANDS  # the cli module imports no torch

            if "proxy" not in SUBCOMMANDS:
                raise ValueError("num_proxies: this kvguard has no `kvguard proxy` subcommand")
        # listed before they start, so that close() ends whichever did start if one fails
        if spec.redis:
            self.redis = self._redis_child()
        self.replicas = [self._replica_child(index) for index in range(spec.num_replicas)]
        first = [self.redis] if self.redis is not None else []
        _at_once(lambda child: child.start(spec.start_timeout_s), [*first, *self.replicas])
        # the proxies need the replicas' URLs (and redis's): they start once those are healthy
        self.proxies = [self._proxy_child(index) for index in range(spec.num_proxies)]
        _at_once(lambda child: child.start(spec.start_timeout_s), self.proxies)
        if spec.num_epps:
            self._start_envoy_front()
        if spec.entry_envoy:
            self._start_entry_envoy()

    def _start_entry_envoy(self) -> None:
        """One Envoy in front of the (started) proxies, the clients' only entry."""
        from chaos.envoy_entry import entry_child

        admin_port = free_port()
        self._envoy_dir = tempfile.TemporaryDirectory(prefix="kvguard-envoy-")
        self.envoy = entry_child(self.proxy_urls, Path(self._envoy_dir.name), admin_port,
                                 niceness=self.spec.niceness)
        self.envoy_admin_url = f"http://127.0.0.1:{admin_port}"
        self.envoy.start(self.spec.start_timeout_s)

    def _start_envoy_front(self) -> None:
        """The EPPs (they need the replicas' URLs and redis's), then Envoy in front of them."""
        from chaos.envoy_front import envoy_child, epp_child, epp_id

        spec = self.spec

        def named(index: int) -> tuple[str, ...]:
            # split with several EPPs: each names itself, and Envoy routes each request's
            # observer stream back to the EPP whose name its decision set
            return ("--epp-id", epp_id(index)) if spec.split and spec.num_epps > 1 else ()
        self.epps = [epp_child(self.replica_urls, redis_url=self.redis_url,
                               extra_args=(*spec.proxy_args, *named(index)),
                               name=f"epp-{index}", niceness=spec.niceness)
                     for index in range(spec.num_epps)]
        _at_once(lambda child: child.start(spec.start_timeout_s), self.epps)
        self._envoy_dir = tempfile.TemporaryDirectory(prefix="kvguard-envoy-")
        admin_port = free_port()
        self.envoy = envoy_child([e.port for e in self.epps], Path(self._envoy_dir.name),
                                 niceness=spec.niceness, split=spec.split,
                                 admin_port=admin_port)
        self.envoy_admin_url = f"http://127.0.0.1:{admin_port}"
        self.envoy.start(spec.start_timeout_s)

    def _replica_child(self, index: int) -> ChildProcess:
        # "{replica}" in an argument becomes the replica's index (a trace file per replica)
        args = tuple(a.replace("{replica}", str(index)) for a in self.spec.replica_args)
        return ChildProcess(
            f"replica-{index}",
            lambda port: [sys.executable, "-m", "guard.cli", "engine", *args,
                          "--host", "127.0.0.1", "--port", str(port)],
            http_health, ready_pattern=_ENGINE_READY, port=free_port(), env=dict(self.spec.env),
            niceness=self.spec.niceness)

    def _proxy_child(self, index: int) -> ChildProcess:
        return self.proxy_child(self.spec.proxy_args, f"proxy-{index}")

    def proxy_child(self, args: Sequence[str], name: str = "proxy") -> ChildProcess:
        """A ``kvguard proxy`` in front of every replica with these extra ``args``, not yet
        started (``.start()`` it; the caller ends it): a bench starts one per run while the
        replicas stay up."""
        args = tuple(args)
        for flag in ("--host", "--port", "--upstream"):
            if flag in args:
                raise ValueError(f"{flag}: the topology sets it; leave it out of the args")
        upstreams = [arg for r in self.replicas for arg in ("--upstream", r.url)]
        env = dict(self.spec.env)
        if self.redis is not None:
            env["KVGUARD_REDIS_URL"] = self.redis_url
        return ChildProcess(
            name,
            lambda port: [sys.executable, "-m", "guard.cli", "proxy", *upstreams, *args,
                          "--host", "127.0.0.1", "--port", str(port)],
            http_health, ready_pattern=_PROXY_READY, port=free_port(), env=env,
            niceness=self.spec.niceness)

    def _redis_child(self) -> ChildProcess:
        port = free_port()
        child = ChildProcess(
            "redis", lambda p: ["redis-server", "--port", str(p), "--bind", "127.0.0.1",
                                "--save", "", "--appendonly", "no"],
            lambda url: redis_health(f"redis://127.0.0.1:{port}"), port=port,
            niceness=self.spec.niceness)
        return child

    def restart_replicas(self) -> None:
        """Restart every replica on its own port, all at once (each starts cold: empty queue
        and prefix cache); ready when this returns."""
        _at_once(lambda child: child.restart(self.spec.start_timeout_s), self.replicas)

    @property
    def replica_urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    @property
    def proxy_urls(self) -> list[str]:
        return [p.url for p in self.proxies]

    @property
    def entry_urls(self) -> list[str]:
        """Where clients connect: Envoy (in front of the EPPs or the proxies), else the
        proxies, else the replicas."""
        if self.envoy is not None:
            return [self.envoy.url]
        return self.proxy_urls or self.replica_urls

    @property
    def redis_url(self) -> str | None:
        return None if self.redis is None else f"redis://127.0.0.1:{self.redis.port}"

    def close(self) -> None:
        """End every child by pid: Envoy, the EPPs and proxies, then the replicas, then redis
        (the children of one kind at once). Safe to call twice."""
        for children in ([self.envoy] if self.envoy else [], self.epps, self.proxies,
                         self.replicas, [self.redis] if self.redis else []):
            with contextlib.suppress(Exception):
                _at_once(lambda child: child.close(), children)
        if self._envoy_dir is not None:
            self._envoy_dir.cleanup()
            self._envoy_dir = None


def _at_once(action: Callable[[ChildProcess], object], children: Sequence[ChildProcess]) -> None:
    """``action(child)`` for every child at the same time, one thread each (starting a child
    is mostly waiting for its imports and its health check; on two cores two starts take about
    as long as one). Once every action has returned, the error of the first child (in the
    given order) whose action failed is raised."""
    if len(children) <= 1:
        for child in children:
            action(child)
        return
    errors: dict[int, BaseException] = {}

    def run(index: int, child: ChildProcess) -> None:
        try:
            action(child)
        except BaseException as exc:  # handed to the caller's thread below
            errors[index] = exc

    threads = [threading.Thread(target=run, args=(i, child), daemon=True,
                                name=f"topology-{child.name}") for i, child in enumerate(children)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[min(errors)]

