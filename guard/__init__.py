"""kvguard guard package."""

__all__: list[str] = []
