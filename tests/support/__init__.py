"""Helpers shared by the tests: builders, clocks, loopback servers."""
