"""The standalone proxy: ``kvguard proxy`` in front of N replicas over HTTP.

:mod:`guard.proxy.app` (the ASGI app), :mod:`guard.proxy.upstream` (forwarding, failover),
:mod:`guard.proxy.transports` (pooled HTTP clients; their shared contract and exception tree in
:mod:`guard.proxy.upstream_contract`), :mod:`guard.proxy.health` (ejection and
probes), :mod:`guard.proxy.config` (the ``[proxy]`` table), :mod:`guard.proxy.cli`. Nothing is
imported here, so ``guard.config`` can use the config without loading the HTTP clients.
"""

__all__: list[str] = []
