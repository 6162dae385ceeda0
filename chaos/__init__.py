"""kvguard chaos package."""

__all__: list[str] = []
