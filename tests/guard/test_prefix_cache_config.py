"""The prefix-cache configuration keys: defaults, validation naming the key, env overrides."""

import pytest

from guard.config import GuardConfig, load_config


def test_defaults_approximate_and_shared():
    config = GuardConfig()
    assert config.prefix_cache == "approximate" and config.prefix_cache_isolation == "shared"
    assert "prefix_cache_secret" not in repr(GuardConfig(prefix_cache_secret="x" * 20))


@pytest.mark.parametrize("data, key", [
    ({"prefix_cache": "exact"}, "prefix_cache"),
    ({"prefix_cache": "precise"}, "prefix_cache"),  # no tokenizer
    ({"prefix_cache_isolation": "user"}, "prefix_cache_isolation"),
    ({"prefix_cache_chunk_chars": 0}, "prefix_cache_chunk_chars"),
    ({"prefix_cache_max_blocks": True}, "prefix_cache_max_blocks"),
    ({"prefix_cache_max_sessions": -1}, "prefix_cache_max_sessions"),
    ({"prefix_cache_secret": "short"}, "prefix_cache_secret"),
    ({"replicas": [{"url": "http://h:1", "kv_events_endpoint": "http://h:2"}]},
     "kv_events_endpoint"),
])
def test_bad_values_name_their_key(data, key):
    with pytest.raises(ValueError, match=key):
        GuardConfig.from_dict(data)


def test_environment_overrides(tmp_path):
    env = {"KVGUARD_PREFIX_CACHE": "off", "KVGUARD_PREFIX_CACHE_ISOLATION": "tenant",
           "KVGUARD_PREFIX_CACHE_CHUNK_CHARS": "128"}
    config = load_config(None, env=env)
    assert (config.prefix_cache, config.prefix_cache_isolation,
            config.prefix_cache_chunk_chars) == ("off", "tenant", 128)
    replica = GuardConfig.from_dict({"replicas": [
        {"url": "http://h:1", "kv_events_endpoint": "tcp://h:5557"}]}).replicas[0]
    assert replica.kv_events_endpoint == "tcp://h:5557"
