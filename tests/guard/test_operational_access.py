"""Operational endpoints behind the admin key: when the gate is on, and who passes (pure)."""

import pytest

from guard.config import GuardConfig, hash_api_key, load_config
from guard.operational_access import OperationalAccess

TENANTS = [{"name": "acme", "api_key": "sk-acme"}]


def _access(**config) -> OperationalAccess:
    return OperationalAccess(GuardConfig.from_dict({"tenants": TENANTS, **config}))


@pytest.mark.parametrize(("config", "enabled"), [
    ({}, False),  # anonymous allowed (the default)
    ({"allow_anonymous": False}, True),
    ({"allow_anonymous": False, "protect_operational_endpoints": False}, False),
    ({"protect_operational_endpoints": True}, True),
])
def test_on_by_default_exactly_when_anonymous_is_refused(config, enabled):
    assert _access(**config).enabled is enabled


def test_no_tenants_means_anonymous_so_off():
    assert not OperationalAccess(GuardConfig.from_dict({"allow_anonymous": False})).enabled


@pytest.mark.parametrize(("path", "key", "status"), [
    ("/kvguard/state", None, 401), ("/kvguard/state", "sk-nope", 401),
    ("/kvguard/state", "sk-acme", 403), ("/kvguard/state", "sk-admin", None),
    ("/metrics", "sk-acme", 403), ("/kvguard/metrics", "sk-admin", None),
    ("/v1/models", None, 401), ("/v1/models", "sk-acme", None), ("/v1/models", "sk-admin", None),
    ("/health", None, None), ("/v1/completions", None, None),  # open / the guard's own auth
])
def test_who_passes(path, key, status):
    access = _access(allow_anonymous=False, admin_api_key="sk-admin")
    headers = {"authorization": f"Bearer {key}"} if key else {}
    rejection = access.check(path, headers)
    assert (rejection.status if rejection else None) == status
    if rejection is not None:
        assert not rejection.should_retry and rejection.retry_after_s is None


def test_without_an_admin_key_the_admin_endpoints_answer_nobody():
    access = _access(allow_anonymous=False)
    assert access.check("/kvguard/state", {"authorization": "Bearer sk-acme"}).status == 403
    assert access.check("/v1/models", {"authorization": "Bearer sk-acme"}) is None


def test_admin_key_is_stored_hashed_and_read_from_the_environment(tmp_path):
    config = GuardConfig.from_dict({"admin_api_key": "sk-admin"})
    assert config.admin_key_sha256 == hash_api_key("sk-admin") and config.is_admin_key("sk-admin")
    assert not config.is_admin_key("sk-other") and not config.is_admin_key(None)
    from_env = load_config(env={"KVGUARD_ADMIN_API_KEY": "sk-env",
                                "KVGUARD_PROTECT_OPERATIONAL_ENDPOINTS": "true"})
    assert from_env.is_admin_key("sk-env") and from_env.protects_operational_endpoints


@pytest.mark.parametrize(("data", "match"), [
    ({"admin_api_key": "a", "admin_key_sha256": "b" * 64}, "not both"),
    ({"admin_key_sha256": "xyz"}, "64 lower-case hex"),
    ({"admin_api_key": "sk-acme", "tenants": TENANTS}, "differ from every tenant"),
    ({"admin_api_key": 5}, "admin_api_key"),
    ({"protect_operational_endpoints": "yes"}, "protect_operational_endpoints"),
    ({"max_idempotency_bytes": 100}, "max_idempotency_bytes"),
])
def test_bad_admin_settings_are_clear_errors(data, match):
    with pytest.raises(ValueError, match=match):
        GuardConfig.from_dict(data)
