"""Checks shared by the config dataclasses (guard budgets, proxy, server limits): one wording
and one rule for every number a user can set, so ``0``, ``True``, ``inf`` or ``"5"`` get the
same clear error wherever they are written."""

from __future__ import annotations

import math

__all__ = ["require_count", "require_seconds"]


def require_seconds(key: str, value: object, *, allow_zero: bool = False) -> None:
    """A finite number of seconds, > 0 (or >= 0 with ``allow_zero``); ValueError naming
    ``key`` otherwise."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{key}: must be a finite number of seconds {bound}, got {value!r}")


def require_count(key: str, value: object, *, minimum: int = 1, note: str = "") -> None:
    """An integer >= ``minimum`` (never a bool); ValueError naming ``key`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key}: must be an integer >= {minimum}{note}, got {value!r}")
