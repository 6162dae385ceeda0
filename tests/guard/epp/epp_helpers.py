"""Shared by the Envoy + ``kvguard epp`` tests: bodies, configs, polling and metrics helpers."""

import re
import time

MODEL = "llama-7b"
BODIES = {
    "/v1/completions": {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 6},
    "/v1/chat/completions": {"model": MODEL, "max_tokens": 6,
                             "messages": [{"role": "user", "content": "hello there"}]},
}
MAX_BODY_BYTES = 4096
CONFIG = f"""
policy = "slo"
refresh_interval_s = 0.1
state_timeout_s = 0.5
max_body_bytes = {MAX_BODY_BYTES}
allow_anonymous = true
[proxy]
drain_timeout_s = 20.0
[[tenants]]
name = "acme"
api_key = "k-acme"
requests_per_minute = 2
"""
SATURATED = """
policy = "saturation"
refresh_interval_s = 0.05
[policy_params]
max_waiting = 0
max_kv_usage_ratio = 0.001
"""
# the sim at a fifth of real speed: a 7B decode step of ~7 ms takes ~35 ms, so a long stream
# is still running when the test acts on it
REPLICA_ARGS = ("--model", MODEL, "--backend", "sim", "--time-scale", "5")



def write_config(tmp_path_factory, text: str, name: str) -> str:
    path = tmp_path_factory.mktemp("epp") / name
    path.write_text(text)
    return str(path)


def endpoints(fleet) -> dict[str, str]:
    return {f"r{i}": url.removeprefix("http://") for i, url in enumerate(fleet.replica_urls)}


def metric(client, url: str, name: str) -> float:
    text = client.get(url).text
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match is not None, f"{name} not in the EPP's metrics"
    return float(match.group(1))


def until(check, timeout_s: float = 10.0) -> bool:
    """Poll ``check`` until it holds (a hang guard, not a timing assertion)."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        if check():
            return True
        time.sleep(0.05)
    return check()


