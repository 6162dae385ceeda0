"""Validation of policy parameters: a clear ValueError naming the parameter."""

from __future__ import annotations

__all__ = ["check_int", "check"]


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int ``>= minimum`` (bools are not ints here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
