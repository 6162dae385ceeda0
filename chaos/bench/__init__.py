"""Benchmark and measurement tooling: never imported by the product packages."""
