"""kvguard policies package."""

__all__: list[str] = []
