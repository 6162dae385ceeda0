"""The bench's floor proxies (``chaos.passthrough``): real processes on loopback in front of a
raw-HTTP upstream; a stream and a JSON answer come through unchanged in both modes."""

import argparse
import json
import sys

import httpx
import pytest

from chaos.bench import proxy as proxy_bench
from chaos.child import ChildProcess
from chaos.topology import http_health
from tests.guard.proxy.proxy_helpers import running, upstream_child


def _passthrough(mode: str, upstream: str) -> ChildProcess:
    return ChildProcess(f"passthrough-{mode}", lambda port: [
        sys.executable, "-m", "chaos.passthrough", "--mode", mode, "--upstream", upstream,
        "--port", str(port)], http_health, ready_pattern=r"passthrough listening on (\S+)")


@pytest.mark.parametrize("mode", ["tcp", "http", "asgi"])
def test_passthrough_relays_streams_and_json_unchanged(mode):
    with running(upstream_child("ok")) as upstream, \
            running(_passthrough(mode, upstream.url)) as proxy, \
            httpx.Client(timeout=30.0, trust_env=False) as client:
        body = {"model": "fake-model", "prompt": "hi", "max_tokens": 3, "stream": True}
        with client.stream("POST", proxy.url + "/v1/completions", json=body) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert response.headers["content-type"] == "text/event-stream"
        texts = [json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]]
        assert texts == ["a", " b", " c"] and lines[-1] == "data: [DONE]"
        answer = client.post(proxy.url + "/v1/completions", json={**body, "stream": False})
        assert answer.status_code == 200 and answer.json()["usage"]["total_tokens"] == 6
        assert client.get(upstream.url + "/count").json() == {"posts": 2}
        # one client connection, one request at a time: one kept-alive upstream connection
        posting = [c for c in client.get(upstream.url + "/connections").json()
                   if any(r.startswith("POST") for r in c)]
        assert len(posting) == 1


def test_passthrough_refuses_an_upstream_that_is_not_an_http_url():
    with pytest.raises(SystemExit):
        from chaos.passthrough import main
        main(["--mode", "tcp", "--upstream", "127.0.0.1:80"])


def test_bench_against_must_be_a_kvguard_checkout(tmp_path):
    parser = argparse.ArgumentParser()
    proxy_bench.configure(parser)
    args = parser.parse_args(["--against", str(tmp_path), "--no-litellm"])
    with pytest.raises(ValueError, match="not a kvguard checkout"):
        proxy_bench.run(args)


def _bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    proxy_bench.configure(parser)
    return parser.parse_args([*argv, "--no-litellm"])


def test_bench_copies_and_defaults_only_pick_the_kvguard_targets():
    ours, targets = proxy_bench._variants(_bench_args())
    assert list(targets) == list(proxy_bench.VARIANTS) == list(ours)
    ours, targets = proxy_bench._variants(_bench_args("--defaults-only", "--copies", "2"))
    assert list(ours) == ["kvguard defaults always_admit", "kvguard defaults slo"]
    assert list(targets) == ["kvguard defaults always_admit", "kvguard defaults always_admit #2",
                             "kvguard defaults slo", "kvguard defaults slo #2"]
    assert targets["kvguard defaults slo #2"] == proxy_bench.VARIANTS["kvguard defaults slo"]


@pytest.mark.parametrize("argv", [("--copies", "0"), ("--defaults-only", "--stacks")])
def test_bench_refuses_copies_below_one_and_defaults_only_with_stacks(argv):
    with pytest.raises(ValueError):
        proxy_bench.run(_bench_args(*argv))


def test_bench_rounds_shuffle_the_targets_so_none_always_follows_the_same_one():
    names = ["direct", "a", "a #2", "slo", "slo #2"]
    orders = proxy_bench.round_orders(names, 200)
    assert all(sorted(order) == sorted(names) for order in orders)  # each round: every target
    assert orders == proxy_bench.round_orders(names, 200)  # seeded: a run repeats it
    after_slo = {order[order.index("slo") + 1] for order in orders if order[-1] != "slo"}
    assert after_slo == set(names) - {"slo"}  # not always the same neighbour


def test_bench_refuses_a_negative_gap():
    with pytest.raises(ValueError, match="gap-ms"):
        proxy_bench.run(_bench_args("--gap-ms", "-1"))


def test_bench_out_is_made_ready_before_measuring_and_bad_input_changes_nothing(tmp_path,
                                                                              monkeypatch):
    out = tmp_path / "new" / "deeper" / "bench.json"
    with pytest.raises(ValueError, match="gap-ms"):
        proxy_bench.run(_bench_args("--out", str(out), "--gap-ms", "-1"))
    assert not out.parent.exists()  # refused input: nothing made
    with pytest.raises(ValueError, match="is a folder"):  # before anything starts
        proxy_bench.run(_bench_args("--out", str(tmp_path), "--requests", "1",
                                    "--shed-rate", "0"))
    made = []

    def measured(args, work):  # stands in for the minutes of measuring
        made.append(out.parent.is_dir())
        return {}

    monkeypatch.setattr(proxy_bench, "_latency", measured)
    monkeypatch.setattr(proxy_bench, "_print_latency", lambda rows: None)
    assert proxy_bench.run(_bench_args("--out", str(out), "--requests", "1",
                                       "--shed-rate", "0")) == 0
    assert made == [True]  # the folder existed before the measuring began
    assert json.loads(out.read_text())["latency"] == {}
