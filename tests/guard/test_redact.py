"""guard.redact: URLs and config values as kvguard may print them."""

import pytest

from guard.redact import redact_url, redact_value


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://user:s3cret@cache:6379/0", "redis://user:***@cache:6379/0"),
    ("redis://:s3cret@cache:6379", "redis://:***@cache:6379"),
    ("rediss://s3cret@cache", "rediss://***@cache"),  # a lone userinfo is a password to redis
    ("redis://user:s3c@r/et@cache:6379/0", "redis://user:***@cache:6379/0"),  # raw '@' and '/'
    ("unix:///run/redis.sock?db=0&password=s3cret", "unix:///run/redis.sock?db=0&password=***"),
    ("redis://cache:6379/0", "redis://cache:6379/0"),
    ("http://10.0.0.7:8000", "http://10.0.0.7:8000"),
    ("not a url at all", "not a url at all"),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown


def test_redact_value_hides_secret_keys_only():
    assert redact_value("tenants.api_key", 1234) == "***"
    assert redact_value("admin_api_key", ["k"]) == "***"
    assert redact_value("redis_url", "redis://:pw@h") == repr("redis://:***@h")
    assert redact_value("max_body_bytes", "big") == repr("big")


def test_the_proxy_state_page_shows_replica_urls_without_their_password():
    import asyncio

    from prometheus_client import CollectorRegistry

    from guard.config import GuardConfig, ReplicaConfig
    from guard.proxy.app import ProxyApp

    async def main():
        config = GuardConfig(replicas=(ReplicaConfig("r0", "http://ops:pw-s3cret@127.0.0.1:9",
                                                     "none"),))
        app = ProxyApp(config, registry=CollectorRegistry())
        try:
            assert app.state()["replicas"][0]["url"] == "http://ops:***@127.0.0.1:9"
        finally:
            await app.aclose()

    asyncio.run(asyncio.wait_for(main(), 10))


def test_redact_text_hides_credentials_in_an_exception_dump():
    from guard.redact import redact_text

    dump = ("ClientResponseError(RequestInfo(url=URL('http://ops:pw1@10.0.0.7:8000/v1'), "
            "headers=<CIMultiDictProxy('Host': '10.0.0.7:8000', 'Authorization': 'Bearer "
            "sk-tenant-123', 'x-api-key': 'k-456')>), message='Bad status line')")
    shown = redact_text(dump)
    for secret in ("pw1", "sk-tenant-123", "k-456"):
        assert secret not in shown
    assert "10.0.0.7:8000" in shown and "Bad status line" in shown
    assert redact_text("Authorization: Basic dXNlcjpwdw==") == "Authorization: Basic ***"
