"""What a client is told about a replica's failure: the replica's id, never its address.

The transports' exceptions name the upstream's host, port and URL (useful in the proxy's own
log); a 502/504 body or a stream's closing error event carries only
:func:`failure_message`'s text, so the client learns which replica failed (``x-kvguard-replica``
names it too) and how, not where the fleet lives. The exception goes to the proxy's log at
DEBUG, its credentials redacted (a client library's message may dump the request's headers).
"""

from __future__ import annotations

import logging

from guard.proxy.transports import (
    UpstreamBroken,
    UpstreamMalformed,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from guard.redact import redact_text

__all__ = ["failure_message"]

log = logging.getLogger("kvguard.proxy")


def failure_message(replica_id: str, exc: BaseException) -> str:
    """The client-facing sentence for ``exc`` raised by a request to ``replica_id``."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("proxy: replica %s failed: %s", replica_id, redact_text(str(exc)))
    if isinstance(exc, UpstreamTimeout):
        return f"replica {replica_id} sent nothing within the read timeout"
    if isinstance(exc, UpstreamMalformed):
        return f"replica {replica_id} answered with a malformed HTTP response"
    if isinstance(exc, UpstreamBroken):
        return f"replica {replica_id} cut the response short"
    if isinstance(exc, UpstreamUnreachable):
        return f"replica {replica_id} could not be reached or closed the connection before answering"
    return f"replica {replica_id} failed"
