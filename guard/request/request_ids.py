"""Request ids at the guard's edge: the client's ``x-request-id`` kept when sane, the guard's own
id in a header of its own (and the name of the header that says a ``max_tokens`` was filled in).

Every response the proxy sends (relayed, shed or refused) carries ``x-request-id``: the client's
own when it sent a sane one (printable ASCII, 1 to ``MAX_CLIENT_ID_BYTES`` bytes), else the
guard's id; and ``x-kvguard-request-id``: the guard's id (the one in its trace and metrics and
sent upstream as ``x-request-id``, which the replica's state and trace report requests by; a
client's id could repeat across clients, so it does not replace it upstream).
"""

from __future__ import annotations

__all__ = ["GUARD_REQUEST_ID_HEADER", "MAX_CLIENT_ID_BYTES", "MAX_TOKENS_HEADER",
           "client_request_id", "id_headers"]

MAX_CLIENT_ID_BYTES = 128
GUARD_REQUEST_ID_HEADER = b"x-kvguard-request-id"
# on a response whose request came without max_tokens: the value the guard priced and sent
MAX_TOKENS_HEADER = b"x-kvguard-max-tokens"
_REQUEST_ID_HEADER = b"x-request-id"


def client_request_id(value: str | None) -> str | None:
    """The client's ``x-request-id`` when it is sane (printable ASCII, at most
    ``MAX_CLIENT_ID_BYTES`` bytes, not empty); None otherwise."""
    if not value or len(value) > MAX_CLIENT_ID_BYTES:
        return None
    for char in value:
        if not " " <= char <= "~":
            return None
    return value


def id_headers(client_id: str | None, guard_id: str | None) -> list[tuple[bytes, bytes]]:
    """The response's ``x-request-id`` (the client's, else the guard's) and
    ``x-kvguard-request-id`` (the guard's; absent when the guard made none)."""
    headers = []
    echoed = client_id or guard_id
    if echoed:
        headers.append((_REQUEST_ID_HEADER, echoed.encode()))
    if guard_id:
        headers.append((GUARD_REQUEST_ID_HEADER, guard_id.encode()))
    return headers
