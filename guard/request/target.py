"""The request target: which path admission decides on, and the exact bytes forwarded.

The guard prices a request by its path (a chat or a completion) and a replica runs it by its
path, so both must read the same one. :func:`read_target` takes the target as the client sent
it (still percent-encoded: an ASGI scope's ``raw_path`` and ``query_string``, or what kvguard's
server parsed) and returns a :class:`Target`: ``path``, the percent-decoded path that admission
decides on, and ``raw``, the target as sent, which is what the proxy forwards, unchanged. The
middleware and the proxy both call it, on every server.

Refused with a 400 (``invalid_request_target``, ``x-should-retry: false``, before any pricing, so
no budget is charged; :func:`read_target` returns the :class:`~guard.errors.PricingError` and the
adapter hands it to the controller as an unread request, which answers and counts it like any
other rejection):

* a target that is not an origin-form ``path [ "?" query ]`` of RFC 3986 characters (RFC 9112
  §3.2.1): a byte outside printable ASCII, a space, ``#``, a ``%`` not followed by two hex
  digits, a character the grammar leaves out (``\\``, ``"``, ``{`` …);
* a target that reads as an admitted path in more than one way: its path hides a separator
  behind an escape (``%2F``, ``%3F``, ``%23``, any case) or holds a dot segment (``.``,
  ``..``, encoded or not), and one of its readings (decoded; decoded and cut at the hidden
  ``?``/``#``; with its dot segments removed) is an admitted path. A replica that decodes,
  splits or normalises differently from the guard would otherwise run another path than the
  one priced (``/v1/completions%3F/v1/chat/completions`` priced as a chat, run as a
  completion).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple
from urllib.parse import quote, unquote

from guard.errors import PricingError

__all__ = ["Target", "read_target", "scope_target", "is_request_target", "INVALID_TARGET"]

INVALID_TARGET = "invalid_request_target"

_PCHAR = rb"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|%[0-9A-Fa-f]{2})"
_PATH = re.compile(rb"(?:/" + _PCHAR + rb"*)+")
_QUERY = re.compile(rb"(?:" + _PCHAR + rb"|[/?])*")
# the same grammar for targets without a "%" (most): one character class, no alternation
_PLAIN_PATH = re.compile(rb"/[A-Za-z0-9\-._~!$&'()*+,;=:@/]*")
_PLAIN_QUERY = re.compile(rb"[A-Za-z0-9\-._~!$&'()*+,;=:@/?]*")
_HIDDEN_SEPARATOR = re.compile(r"%(?:2[fF]|3[fF]|23)")
_HIDDEN_END = re.compile(r"%(?:3[fF]|23)")  # an encoded "?" or "#"
_DOT_SEGMENT = re.compile(r"(?:^|/)\.\.?(?:/|$)")


class Target(NamedTuple):
    """A target admission can decide on: ``path`` decoded, ``raw`` as sent (path and
    ``?query``), ``admitted``: a ``POST`` to it goes through admission."""

    path: str
    raw: str
    admitted: bool


def is_request_target(target: bytes) -> bool:
    """True when ``target`` is an origin-form request target (``/path`` with an optional
    ``?query``) made only of the characters RFC 3986 allows there."""
    path, question, query = target.partition(b"?")
    return _PATH.fullmatch(path) is not None and (
        not question or _QUERY.fullmatch(query) is not None)


def scope_target(scope: dict, is_admitted: Callable[[str], bool]) -> Target | PricingError:
    """:func:`read_target` of an ASGI HTTP scope (``raw_path``; a server that leaves it out
    gives only the decoded ``path``, read here re-encoded)."""
    raw_path = scope.get("raw_path")
    if raw_path is None:
        raw_path = quote(scope["path"], safe="/:@!$&'()*+,;=~").encode("ascii")
    return read_target(raw_path, scope.get("query_string", b""), is_admitted)


def read_target(raw_path: bytes, query_string: bytes,
                is_admitted: Callable[[str], bool]) -> Target | PricingError:
    """The :class:`Target` of a request whose target was ``raw_path`` (percent-encoded) and
    ``query_string`` (without its ``?``); a 400 :class:`~guard.errors.PricingError` for one the
    guard refuses
    (see the module docstring)."""
    if (_PLAIN_PATH.fullmatch(raw_path) is None and _PATH.fullmatch(raw_path) is None) or (
            query_string and _PLAIN_QUERY.fullmatch(query_string) is None
            and _QUERY.fullmatch(query_string) is None):
        return _refuse("the request target is not a valid origin-form target "
                       "(RFC 9112 section 3.2.1)")
    encoded = raw_path.decode("ascii")
    raw = f"{encoded}?{query_string.decode('ascii')}" if query_string else encoded
    path = unquote(encoded) if "%" in encoded else encoded
    if "%" not in encoded and "." not in encoded:  # one reading only: the usual target
        return Target(path, raw, is_admitted(path))
    readings = [path]
    if _HIDDEN_SEPARATOR.search(encoded) is not None:
        cut = _HIDDEN_END.search(encoded)
        if cut is not None:
            readings.append(unquote(encoded[:cut.start()]))
    elif _DOT_SEGMENT.search(path) is None:
        return Target(path, raw, is_admitted(path))
    readings.append(_remove_dot_segments(path))
    if any(is_admitted(reading) for reading in readings):
        return _refuse("the request path hides a separator behind an escape (%2F, %3F, %23) "
                       "or holds a dot segment; send the admitted path as it is")
    return Target(path, raw, False)


def _remove_dot_segments(path: str) -> str:
    """``path`` with its ``.`` and ``..`` segments resolved (RFC 3986 §5.2.4)."""
    out: list[str] = []
    segments = path.split("/")[1:]
    for i, segment in enumerate(segments):
        last = i == len(segments) - 1
        if segment == "..":
            if out:
                out.pop()
            if last:
                out.append("")
        elif segment == ".":
            if last:
                out.append("")
        else:
            out.append(segment)
    return "/" + "/".join(out)


def _refuse(message: str) -> PricingError:
    return PricingError(400, INVALID_TARGET, message)
