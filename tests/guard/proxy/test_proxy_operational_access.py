"""The proxy's operational endpoints behind the admin key when anonymous is refused
(in-process ASGI; no upstream is contacted for these routes)."""

import asyncio

import httpx
import pytest

from guard.config import GuardConfig
from guard.proxy.app import ProxyApp

CONFIG = {"allow_anonymous": False, "admin_api_key": "sk-admin",
          "tenants": [{"name": "acme", "api_key": "sk-acme"}],
          "replicas": [{"replica_id": "r0", "url": "http://127.0.0.1:9", "state_source": "none"}]}


@pytest.mark.parametrize(("path", "key", "status"), [
    ("/kvguard/state", None, 401), ("/kvguard/state", "sk-acme", 403),
    ("/kvguard/state", "sk-admin", 200), ("/kvguard/metrics", None, 401),
    ("/kvguard/metrics", "sk-admin", 200), ("/metrics", "sk-acme", 403),
])
def test_proxy_operational_endpoints_need_the_admin_key(path, key, status):
    async def main():
        app = ProxyApp(GuardConfig.from_dict(CONFIG))
        headers = {"authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://proxy") as client:
            return await client.get(path, headers=headers)

    response = asyncio.run(main())
    assert response.status_code == status, response.text
    if status != 200:
        assert "acme" not in response.text
