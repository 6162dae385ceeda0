"""``ServerLimits``: how long a client may take and how many connections it may hold.

uvicorn bounds only the idle time between keep-alive requests (``timeout_keep_alive``) and the
size of the request head (h11's 16 KiB); nothing bounds the time to send the head or the body,
or how long a response may wait on a client that stops reading, or the number of connections a
client holds (``limit_concurrency`` answers 503 to *requests*
once the server is full, for everyone). ``serving.limited_protocol`` enforces these limits on
each connection.

CLI flags (``add_limit_arguments``), shared by ``kvguard engine`` and ``kvguard proxy``:
``--header-timeout-s``, ``--body-timeout-s``, ``--keep-alive-timeout-s``, ``--write-timeout-s``,
``--max-connections``, ``--max-connections-per-client``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from serving.checks import require_count, require_seconds

__all__ = ["ServerLimits", "add_limit_arguments", "limits_from_args"]


@dataclass(frozen=True)
class ServerLimits:
    """Per-connection time limits and connection caps (0 disables a cap).

    - ``header_timeout_s``: from the connection's first byte of a request (or from accepting
      it) to the end of the request head.
    - ``body_timeout_s``: from the end of the head to the end of the request body (total).
    - ``keep_alive_timeout_s``: idle time allowed between requests on one connection.
    - ``write_timeout_s``: how long a response may stay blocked on a client that does not read
      (the transport's write buffer over its high-water mark) before the connection is closed.
    - ``max_connections``: open connections in total; more are answered 503 and closed.
    - ``max_connections_per_client``: open connections from one client address. Behind a
      proxy or load balancer every request comes from its address: size this for its pool.
    """

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0
    write_timeout_s: float = 60.0
    max_connections: int = 4096
    max_connections_per_client: int = 1024

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s",
                     "write_timeout_s"):
            require_seconds(name, getattr(self, name))
        for name in ("max_connections", "max_connections_per_client"):
            require_count(name, getattr(self, name), minimum=0, note=" (0: no cap)")


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``ServerLimits`` flags, with its defaults."""
    d = ServerLimits()
    group = parser.add_argument_group("connection limits")
    group.add_argument("--header-timeout-s", type=float, default=d.header_timeout_s,
                       help="close a connection whose request head takes longer "
                       f"(default {d.header_timeout_s:g})")
    group.add_argument("--body-timeout-s", type=float, default=d.body_timeout_s,
                       help="close a connection whose request body takes longer in total "
                       f"(default {d.body_timeout_s:g})")
    group.add_argument("--keep-alive-timeout-s", type=float, default=d.keep_alive_timeout_s,
                       help=f"close an idle keep-alive connection (default {d.keep_alive_timeout_s:g})")
    group.add_argument("--write-timeout-s", type=float, default=d.write_timeout_s,
                       help="close a connection whose client stops reading the response for "
                       f"this long (default {d.write_timeout_s:g})")
    group.add_argument("--max-connections", type=int, default=d.max_connections,
                       help=f"open connections in total, 0: no cap (default {d.max_connections})")
    group.add_argument("--max-connections-per-client", type=int,
                       default=d.max_connections_per_client,
                       help="open connections per client address, 0: no cap "
                       f"(default {d.max_connections_per_client})")


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(header_timeout_s=args.header_timeout_s,
                        body_timeout_s=args.body_timeout_s,
                        keep_alive_timeout_s=args.keep_alive_timeout_s,
                        write_timeout_s=args.write_timeout_s,
                        max_connections=args.max_connections,
                        max_connections_per_client=args.max_connections_per_client)
