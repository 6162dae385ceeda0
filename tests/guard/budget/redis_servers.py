"""Real redis-server processes on free loopback ports for the budget tests (killed by pid)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time

from chaos import ports

__all__ = ["RedisServer", "RedisCluster", "free_port"]


def free_port(cluster_bus: bool = False) -> int:
    """A free loopback port below the ephemeral range (and, for Cluster nodes, port + 10000
    free too): a server that is killed and started again, or started only later in a test,
    finds its port still free (no outgoing connection can take it meanwhile)."""
    return ports.free_port(also_free=10_000 if cluster_bus else 0)


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server; :meth:`kill` and :meth:`restart` keep the port."""

    def __init__(self, port: int | None = None, cluster: bool = False) -> None:
        self.cluster = cluster
        self.port = port or free_port(cluster_bus=cluster)
        self.dir = tempfile.mkdtemp(prefix="kvguard-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", self.dir]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not _ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()  # the caller may never get this object to kill it
                raise RuntimeError(f"redis-server on {self.port} did not start")
            time.sleep(0.05)
        return self

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def restart(self) -> RedisServer:
        self.kill()
        return self.start()

    def cli(self, *args: str) -> str:
        out = subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True,
                             text=True, timeout=10, check=True)
        return out.stdout


class RedisCluster:
    """Three masters (no replicas) joined with ``redis-cli --cluster create``."""

    def __init__(self, num_masters: int = 3) -> None:
        self.nodes = [RedisServer(cluster=True) for _ in range(num_masters)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisCluster:
        for node in self.nodes:
            node.start()
        subprocess.run(["redis-cli", "--cluster", "create",
                        *(f"127.0.0.1:{n.port}" for n in self.nodes),
                        "--cluster-replicas", "0", "--cluster-yes"],
                       capture_output=True, timeout=60, check=True)
        deadline = time.monotonic() + 30
        while not all("cluster_state:ok" in n.cli("cluster", "info") for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("redis cluster did not become ok")
            time.sleep(0.1)
        return self

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()
