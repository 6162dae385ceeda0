"""No silent rewrites, real processes over loopback: the client's ``x-request-id`` comes back
on 200, 429 and 503 (replaced when not sane), the guard's own id travels in
``x-kvguard-request-id``, and a request sent without ``max_tokens`` is forwarded with the priced
value and the response says so — or, with ``missing_max_tokens = "forward"``, goes untouched."""

import socket

import pytest
from proxy_helpers import proxy_child, running, upstream_child, write_config

pytestmark = pytest.mark.slow

MODEL = "m"
KEY = "sk-tenant-one"
TENANT = f"""
[[tenants]]
name = "one"
api_key = "{KEY}"
requests_per_minute = 2
"""
AUTH = {"authorization": f"Bearer {KEY}"}


def _proxy(tmp_path, upstream_url: str, extra: str = "", **kwargs):
    config = tmp_path / "proxy.toml"
    base = open(write_config(tmp_path)).read()
    # top-level keys go before the first table
    config.write_text("allow_anonymous = false\n" + extra + base + TENANT + (
        f'[[replicas]]\nreplica_id = "r0"\nurl = "{upstream_url}"\nstate_source = "none"\n'
        f'models = ["{MODEL}"]\n'))
    return proxy_child([], str(config), **kwargs)


def test_the_client_request_id_round_trips_on_200_and_429(tmp_path, client):
    with running(upstream_child("echo", MODEL)) as upstream, \
            running(_proxy(tmp_path, upstream.url)) as proxy:
        ok = client.post(proxy.url + "/v1/completions", headers={**AUTH, "x-request-id": "abc-1"},
                         json={"model": MODEL, "prompt": "hi"})
        assert ok.status_code == 200, ok.text
        guard_id = ok.headers["x-kvguard-request-id"]
        assert ok.headers["x-request-id"] == "abc-1" and guard_id != "abc-1"
        received = ok.json()["received"]
        assert received["headers"]["x-request-id"] == guard_id  # what the replica reports by
        # no max_tokens sent: forwarded with the priced value, and the response says so
        assert received["body"]["max_tokens"] == 256
        assert ok.headers["x-kvguard-max-tokens"] == "256"
        assert ok.headers["x-ratelimit-limit-requests"] == "2"  # OpenAI's, for a budgeted tenant
        assert "x-ratelimit-limit-tokens" not in ok.headers  # no token budget

        sent = client.post(proxy.url + "/v1/completions",
                           headers={**AUTH, "x-request-id": "x" * 129},  # too long: replaced
                           json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert sent.status_code == 200
        assert sent.headers["x-request-id"] == sent.headers["x-kvguard-request-id"]
        assert "x-kvguard-max-tokens" not in sent.headers
        assert sent.json()["received"]["body"]["max_tokens"] == 3

        shed = client.post(proxy.url + "/v1/completions",
                           headers={**AUTH, "x-request-id": "abc-3"},
                           json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert shed.status_code == 429, shed.text
        assert shed.headers["x-request-id"] == "abc-3"
        assert shed.headers["x-kvguard-request-id"] not in ("", "abc-3")
        error = shed.json()["error"]  # OpenAI's conventions; kvguard's reason in its header
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
        assert shed.headers["x-kvguard-reason"] == "rpm_limit"
        assert shed.headers["x-ratelimit-remaining-requests"] == "0"
        reset_s = float(shed.headers["x-ratelimit-reset-requests"].removesuffix("s"))
        assert 0 < reset_s <= 60 and reset_s <= float(shed.headers["retry-after"])
        assert "requests per minute" in error["message"]

        refused = client.post(proxy.url + "/v1/completions", headers={"x-request-id": "abc-4"},
                              json={"model": MODEL, "prompt": "hi"})
        assert refused.status_code == 401 and refused.headers["x-request-id"] == "abc-4"
        assert refused.json()["error"]["type"] == "invalid_request_error"
        assert refused.json()["error"]["code"] == "invalid_api_key"


def test_the_client_request_id_round_trips_on_503(tmp_path, client):
    with socket.socket() as dead:  # a port nothing answers on
        dead.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{dead.getsockname()[1]}"
        with running(_proxy(tmp_path, url, healthy=False)) as proxy:
            for _ in range(50):  # until the replica is found down (connect errors: fast)
                shed = client.post(proxy.url + "/v1/completions",
                                   headers={**AUTH, "x-request-id": "abc-503"},
                                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
                if shed.status_code == 503:
                    break
            assert shed.status_code == 503, shed.text
            assert shed.headers["x-request-id"] == "abc-503"
            assert shed.headers["x-kvguard-request-id"]
            assert shed.json()["error"]["message"].startswith("No replica can serve")


def test_missing_max_tokens_forward_sends_the_body_untouched(tmp_path, client):
    with running(upstream_child("echo", MODEL)) as upstream, running(_proxy(
            tmp_path, upstream.url, 'missing_max_tokens = "forward"\n')) as proxy:
        ok = client.post(proxy.url + "/v1/completions", headers=AUTH,
                         json={"model": MODEL, "prompt": "hi"})
        assert ok.status_code == 200, ok.text
        assert "max_tokens" not in ok.json()["received"]["body"]
        assert "x-kvguard-max-tokens" not in ok.headers


@pytest.mark.parametrize(("replica_key", "forward", "seen"), [
    ("sk-upstream", False, "Bearer sk-upstream"),   # the replica's own key, not the client's
    (None, False, None),                            # nobody's key
    (None, True, f"Bearer {KEY}"),                  # configured to forward the client's
    ("sk-upstream", True, "Bearer sk-upstream"),    # the replica's own key still wins
])
def test_the_upstream_sees_its_own_key_never_the_clients(tmp_path, client, replica_key, forward,
                                                         seen):
    with running(upstream_child("echo", MODEL)) as upstream:
        config = tmp_path / "proxy.toml"
        key_line = f'api_key = "{replica_key}"\n' if replica_key else ""
        config.write_text("allow_anonymous = false\n" + open(write_config(tmp_path)).read()
                          + f"forward_client_authorization = {str(forward).lower()}\n" + TENANT
                          + f'[[replicas]]\nreplica_id = "r0"\nurl = "{upstream.url}"\n'
                            f'state_source = "none"\nmodels = ["{MODEL}"]\n' + key_line)
        with running(proxy_child([], str(config))) as proxy:
            for stream in (False, True):
                answer = client.post(proxy.url + "/v1/completions", headers=AUTH,
                                     json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                           "stream": stream})
                assert answer.status_code == 200, answer.text
                if not stream:
                    headers = answer.json()["received"]["headers"]
                    assert headers.get("authorization") == seen
