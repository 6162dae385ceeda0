"""Secrets kept out of everything kvguard prints: log lines, error messages, state pages.

A Redis or replica URL may carry a password (``redis://user:secret@host:6379/0``,
``redis://:secret@host``, ``unix:///run/redis.sock?password=secret``). :func:`redact_url` is
the form of such a URL that kvguard may show anyone: the user name stays (it says which
account), the password and every ``password`` query parameter become ``***``. It works on any
string, also one that is not a valid URL (a config error must not echo a mistyped secret).

:func:`redact_value` is the form of a config value that a type error may show: the values of
keys that hold secrets (API keys, the admin key, URLs) are never echoed. :func:`redact_text`
is for free text such as an exception's message (URLs, ``Authorization`` headers).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["MASK", "SECRET_KEY_SUFFIXES", "redact_text", "redact_url", "redact_value"]

MASK = "***"
# config keys (the last dotted part) whose values are secrets or may contain one
SECRET_KEY_SUFFIXES = ("api_key", "key_sha256", "redis_url", "url", "password")

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_PASSWORD_PARAM = re.compile(r"([?&;](?:password|pass|pwd|auth)=)[^&;#]*", re.IGNORECASE)
_USERINFO = re.compile(r"(://)[^\s/@'\"]+@")
_CREDENTIAL = re.compile(
    r"((?:authorization|x-api-key|api-key)['\"]?\s*[:=]\s*['\"]?(?:(?:bearer|basic)\s+)?"
    r"|(?:bearer|basic)\s+)"
    r"[^\s'\",}]+", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` with its password (userinfo, ``password=`` parameters) replaced by ``***``."""
    text = str(url)
    scheme = _SCHEME.match(text)
    start = scheme.end() if scheme else 0
    # the userinfo ends at the last '@' before the path: a password may hold a raw '@' or '/'
    at = text.rfind("@", start)
    if at >= 0:
        userinfo = text[start:at]
        user, colon, _ = userinfo.partition(":")
        # no colon: redis clients read a lone userinfo as a password too
        shown = f"{user}:{MASK}" if colon else MASK
        text = text[:start] + shown + text[at:]
    return _PASSWORD_PARAM.sub(lambda m: m.group(1) + MASK, text)


def redact_text(text: str) -> str:
    """Free text (an exception's message, which may dump a request's URL and headers) with
    URL userinfo, ``password=`` parameters and credential header values as ``***``."""
    text = _USERINFO.sub(lambda m: m.group(1) + MASK + "@", str(text))
    text = _CREDENTIAL.sub(lambda m: m.group(1) + MASK, text)
    return _PASSWORD_PARAM.sub(lambda m: m.group(1) + MASK, text)


def redact_value(key: str, value: Any) -> str:
    """``repr(value)`` for an error message about config ``key``, or ``***`` when the key holds
    a secret (a URL is shown redacted)."""
    name = key.rsplit(".", 1)[-1]
    if not name.endswith(SECRET_KEY_SUFFIXES):
        return repr(value)
    if isinstance(value, str) and name.endswith("url"):
        return repr(redact_url(value))
    return MASK
