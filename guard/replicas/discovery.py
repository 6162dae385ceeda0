"""Where a running proxy learns its replicas: ``[proxy] replicas_from`` (``--replicas-from``).

Three sources, each read at start-up; the first two again every ``replicas_from_interval_s``:

* ``file:PATH``: a file listing the replicas, the way a mounted Kubernetes ConfigMap (or any
  config-management tool) updates them. ``*.json``: a JSON array whose items are base URLs or
  objects with the keys of a ``[[replicas]]`` table (or an object ``{"replicas": [...]}``);
  any other name: TOML with ``[[replicas]]`` tables, exactly as in guard.toml. A URL item gets
  its URL as its id. The file is read again only when its bytes change (a ConfigMap update
  swaps a symlink: comparing bytes catches it where a modification time may not).
* ``dns:NAME:PORT``: the A/AAAA records of ``NAME`` (a Kubernetes headless Service lists one
  per ready pod), each ``http://ADDRESS:PORT`` with the id ``ADDRESS:PORT``. A name that does
  not resolve keeps the replicas last known (a DNS outage is not a fleet leaving).
* ``inferencepool:[NAMESPACE/]POOL``: the Ready pods of a Gateway API inference extension
  ``InferencePool``, listed and then watched through the Kubernetes API
  (:mod:`guard.replicas.inference_pool`); a change is applied as soon as it is seen.

A list that cannot be read or is invalid (bad TOML or JSON, an unknown key, a bad URL, a
duplicate id, no replica at all) is logged as a warning, once per distinct reason, and
changes nothing. :class:`ReplicaWatcher` runs the loop; what a list change does to a proxy
(a join is polled and becomes routable, a leave drains) is :class:`guard.proxy.app.ProxyApp`'s.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import tomllib

from guard.background import cancel_and_wait
from guard.replicas.inference_pool import InferencePoolReplicas, parse_pool_ref

if TYPE_CHECKING:
    from guard.config import ReplicaConfig

__all__ = ["DnsReplicas", "FileReplicas", "ReplicaSource", "ReplicaWatcher", "build_replicas",
           "check_replicas_from", "replica_source"]

log = logging.getLogger(__name__)

Resolve = Callable[[str, int], list[str]]  # host, port -> the addresses it resolves to
ReplicaSource = Union["FileReplicas", "DnsReplicas", InferencePoolReplicas]


def check_replicas_from(spec: Any) -> None:
    """ValueError unless ``spec`` is ``file:PATH``, ``dns:NAME:PORT`` or
    ``inferencepool:[NAMESPACE/]POOL``."""
    _parse(spec)


def _parse(spec: Any) -> tuple[str, str, int]:
    if not isinstance(spec, str):
        raise ValueError(f"proxy.replicas_from: must be a string, got {spec!r}")
    kind, _, rest = spec.partition(":")
    if kind == "file" and rest:
        return "file", rest, 0
    if kind == "dns":
        name, _, port = rest.rpartition(":")
        if name and port.isdigit() and 0 < int(port) < 65536:
            return "dns", name, int(port)
    if kind == "inferencepool":
        try:
            parse_pool_ref(rest)
        except ValueError as exc:
            raise ValueError(f"proxy.replicas_from: {exc}") from None
        return "inferencepool", rest, 0
    raise ValueError("proxy.replicas_from: must be 'file:PATH', 'dns:NAME:PORT' or "
                     f"'inferencepool:[NAMESPACE/]POOL', got {spec!r}")


def replica_source(spec: str, state_source: str = "auto",
                   resolve: Resolve | None = None) -> ReplicaSource:
    """The source ``spec`` names; ``state_source``: how its replicas publish load (a file's
    entries may say otherwise)."""
    kind, where, port = _parse(spec)
    if kind == "file":
        return FileReplicas(Path(where), state_source)
    if kind == "inferencepool":
        namespace, pool = parse_pool_ref(where)
        return InferencePoolReplicas(namespace, pool, state_source)
    return DnsReplicas(where, port, state_source, resolve)


class FileReplicas:
    """The replicas a TOML or JSON file lists."""

    def __init__(self, path: Path, state_source: str = "auto") -> None:
        self.path = path
        self.spec = f"file:{path}"
        self._state_source = state_source
        self._last: bytes | None = None

    def changed(self) -> bool:
        """True when the file's bytes differ from the last read (or cannot be read)."""
        try:
            return self.path.read_bytes() != self._last
        except OSError:
            return True

    def read(self) -> tuple[ReplicaConfig, ...]:
        """The file's replicas; ValueError saying why when it cannot be read or is invalid."""
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read {self.path}: {exc.strerror}") from None
        self._last = data
        if self.path.suffix == ".json":
            try:
                items = json.loads(data)
            except (ValueError, UnicodeDecodeError) as exc:
                raise ValueError(f"{self.path}: invalid JSON: {exc}") from None
            if isinstance(items, dict) and set(items) == {"replicas"}:
                items = items["replicas"]
        else:
            try:
                table = tomllib.loads(data.decode())
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"{self.path}: invalid TOML: {exc}") from None
            unknown = sorted(set(table) - {"replicas"})
            if unknown:
                raise ValueError(f"{self.path}: {unknown[0]}: unknown key (only [[replicas]])")
            items = table.get("replicas", [])
        if not isinstance(items, list):
            raise ValueError(f"{self.path}: must list the replicas (an array)")
        return build_replicas(items, self._state_source, str(self.path))


class DnsReplicas:
    """The addresses ``name`` resolves to, each a replica on ``port``."""

    def __init__(self, name: str, port: int, state_source: str = "auto",
                 resolve: Resolve | None = None) -> None:
        self.name, self.port = name, port
        self.spec = f"dns:{name}:{port}"
        self._state_source = state_source
        self._resolve = resolve or _getaddrinfo

    def changed(self) -> bool:
        return True  # records are only known by asking again

    def read(self) -> tuple[ReplicaConfig, ...]:
        try:
            addresses = self._resolve(self.name, self.port)
        except OSError as exc:
            raise ValueError(f"{self.name} does not resolve: {exc}") from None
        items = []
        for address in sorted(set(addresses), key=_address_key):
            host = f"[{address}]" if ":" in address else address
            items.append({"replica_id": f"{host}:{self.port}",
                          "url": f"http://{host}:{self.port}"})
        return build_replicas(items, self._state_source, self.spec)


def _getaddrinfo(name: str, port: int) -> list[str]:
    return [info[4][0] for info in socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)]


def _address_key(address: str) -> tuple:
    try:
        ip = ipaddress.ip_address(address)
        return (ip.version, int(ip))
    except ValueError:
        return (9, address)


def build_replicas(items: list, state_source: str, where: str) -> tuple[ReplicaConfig, ...]:
    from guard.config import GuardConfig, replica_from

    replicas = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            item = {"replica_id": item.rstrip("/"), "url": item}
        if isinstance(item, dict):
            item = {"state_source": state_source, **item}
        try:
            replicas.append(replica_from(i, item))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    if not replicas:
        raise ValueError(f"{where}: lists no replica")
    try:
        GuardConfig(replicas=tuple(replicas))  # duplicate ids, api_key_env read
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    from guard.config import with_replica_keys

    return with_replica_keys(tuple(replicas))


class ReplicaWatcher:
    """Reads ``source`` every ``interval_s`` and calls ``apply(replicas)`` when its list
    changed; ``tick()`` (optional) runs every round as well. An unreadable or invalid list,
    or one ``apply`` refuses (ValueError), is a warning — once per reason — and changes
    nothing. An ``inferencepool:`` source is followed (its watch runs beside the loop) and a
    change it sees starts the next round at once."""

    def __init__(self, source: ReplicaSource, interval_s: float,
                 apply: Callable[[tuple[ReplicaConfig, ...]], None],
                 current: tuple[ReplicaConfig, ...],
                 tick: Callable[[], Awaitable[None] | None] | None = None) -> None:
        self.source = source
        # a source that follows its list itself (``follow()``, setting ``updated`` on a
        # change: an InferencePool's watch) rather than being read every round
        self._follows = callable(getattr(source, "follow", None))
        self._interval_s = interval_s
        self._apply = apply
        self._current = current
        self._tick = tick
        self._task: asyncio.Task | None = None
        self._last_error: str | None = None
        self.num_applied = 0
        self.num_refused = 0

    async def check(self) -> None:
        """One round: read the source (off the loop for DNS) and apply a changed list."""
        if self.source.changed():
            try:
                if isinstance(self.source, DnsReplicas):
                    replicas = await asyncio.get_running_loop().run_in_executor(
                        None, self.source.read)
                else:
                    replicas = self.source.read()
                if replicas != self._current:
                    self._apply(replicas)
                    self._current = replicas
                    self.num_applied += 1
                self._last_error = None
            except ValueError as exc:
                self._refused(str(exc))
        if self._tick is not None:
            result = self._tick()
            if result is not None:
                await result

    def _refused(self, reason: str) -> None:
        self.num_refused += 1
        if reason != self._last_error:
            self._last_error = reason
            log.warning("replicas_from %s: update ignored, the replicas stay as they were: %s",
                        self.source.spec, reason)

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        following = None
        if self._follows:  # e.g. it watches the Kubernetes API server
            following = asyncio.ensure_future(self.source.follow())
        try:
            while True:
                await self._pause()
                try:
                    await self.check()
                except Exception:  # the loop outlives any one round
                    log.exception("replicas_from %s: round failed", self.source.spec)
        finally:
            await cancel_and_wait(following)

    async def _pause(self) -> None:
        """Until the next round: ``interval_s``, or less when a followed source saw a change."""
        if not self._follows:
            await asyncio.sleep(self._interval_s)
            return
        updated = self.source.updated
        try:
            await asyncio.wait_for(updated.wait(), self._interval_s)
        except asyncio.TimeoutError:
            pass
        updated.clear()

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
