"""Fixtures for the proxy tests (helpers live in proxy_helpers.py)."""

import httpx
import pytest


@pytest.fixture
def client():
    with httpx.Client(timeout=60.0, trust_env=False) as c:
        yield c
