"""Tenant isolation of the prefix cache, tested as an attacker would, end to end over loopback:
``kvguard engine --backend sim`` (prefix cache on) with the guard mounted and
``prefix_cache_isolation = "tenant"``. Alice's prompt, sent again by Alice, is served from the
cache; the same prompt from Bob finds nothing cached (``cached_tokens`` 0), with or without a
salt of his own; a salt that is not a string is a 400 at the guard."""

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from server_helpers import start_engine  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ENGINE_ARGS = ["--model", "llama-7b", "--backend", "sim", "--gpu", "h100-80g",
               "--time-scale", "1", "--max-num-seqs", "8"]
PROMPT = list(range(2000, 2640))  # 640 tokens: 40 full blocks of 16


def _config(tmp_path: Path, isolation: str) -> str:
    path = tmp_path / "guard.toml"
    path.write_text(f'prefix_cache_isolation = "{isolation}"\n'
                    'prefix_cache_secret = "not-known-to-any-client"\n'
                    'allow_anonymous = false\n'
                    '[[tenants]]\nname = "alice"\napi_key = "sk-alice"\n'
                    '[[tenants]]\nname = "bob"\napi_key = "sk-bob"\n')
    return str(path)


def _cached(client: httpx.Client, key: str, **extra) -> int:
    response = client.post("/v1/completions", headers={"authorization": f"Bearer {key}"},
                           json={"model": "llama-7b", "prompt": PROMPT, "max_tokens": 2,
                                 **extra})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_tenant_b_never_hits_tenant_a_cached_prompt(tmp_path):
    with start_engine([*ENGINE_ARGS, "--guard", _config(tmp_path, "tenant")]) as engine, \
            httpx.Client(base_url=engine.base_url, timeout=30.0, trust_env=False) as client:
        assert _cached(client, "sk-alice") == 0
        assert _cached(client, "sk-alice") >= 0.9 * 640  # the cache works for Alice
        assert _cached(client, "sk-bob") == 0  # the attacker: nothing to time
        assert _cached(client, "sk-bob", cache_salt="guessed") == 0
        bad = client.post("/v1/completions", headers={"authorization": "Bearer sk-bob"},
                          json={"model": "llama-7b", "prompt": PROMPT, "max_tokens": 2,
                                "cache_salt": 12})
        assert bad.status_code == 400 and "cache_salt" in bad.text


def test_shared_caches_let_a_tenant_see_another_tenants_prompt(tmp_path):
    """The leak isolation closes: with the default, Bob hits Alice's prompt."""
    with start_engine([*ENGINE_ARGS, "--guard", _config(tmp_path, "shared")]) as engine, \
            httpx.Client(base_url=engine.base_url, timeout=30.0, trust_env=False) as client:
        assert _cached(client, "sk-alice") == 0
        assert _cached(client, "sk-bob") >= 0.9 * 640
