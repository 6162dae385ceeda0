"""Ejection, probes and the gated state source (pure logic: injected clock, probe and
transport)."""

import asyncio
import time

import pytest

from guard.config import GuardConfig
from guard.proxy.app import ProxyApp
from guard.proxy.config import ProxyConfig
from guard.proxy.health import ReplicaEjected, ReplicaHealth
from guard.replicas.poller import NoStateSource, StateUnavailable


class Clock:
    def __init__(self):
        self.now_s = 0.0

    def __call__(self):
        return self.now_s


def make(answers=None, clock=None):
    unhealthy = []
    answers = answers if answers is not None else {}

    async def probe(replica_id):
        return answers.get(replica_id, False)

    health = ReplicaHealth(["a", "b"], 3, 1.0, unhealthy.append, probe, clock or Clock())
    return health, unhealthy, answers


def test_ejects_after_n_consecutive_failures_only():
    health, unhealthy, _ = make()
    assert not health.record_failure("a") and not health.record_failure("a")
    health.record_success("a")  # the run is broken: start again
    assert [health.record_failure("a") for _ in range(3)] == [False, False, True]
    assert health.is_ejected("a") and not health.is_ejected("b")
    assert unhealthy == ["a"] and health.num_ejections == {"a": 1, "b": 0}
    assert not health.record_failure("a")  # already out: no second ejection
    assert health.num_ejections["a"] == 1


def test_probe_readmits_only_after_the_interval_and_a_good_answer():
    clock = Clock()
    health, _, answers = make(clock=clock)
    for _ in range(3):
        health.record_failure("a")
    answers["a"] = True
    asyncio.run(health.probe_ejected())
    assert health.is_ejected("a")  # not due yet
    clock.now_s = 1.0
    answers["a"] = False
    asyncio.run(health.probe_ejected())
    assert health.is_ejected("a")  # due, but it did not answer
    clock.now_s = 1.5
    answers["a"] = True
    asyncio.run(health.probe_ejected())
    assert health.is_ejected("a")  # a failed probe pushes the next one a full interval out
    clock.now_s = 2.0
    asyncio.run(health.probe_ejected())
    assert not health.is_ejected("a") and health.consecutive_failures("a") == 0
    assert health.num_readmissions == {"a": 1, "b": 0}


class Source:
    kind = "kvguard"

    def __init__(self, health):
        self.health = health
        self.eject_during_fetch = False

    async def fetch(self):
        if self.eject_during_fetch:
            for _ in range(3):
                self.health.record_failure("a")
        return {"doc": 1}


def test_gated_source_fails_while_ejected_even_if_ejected_mid_fetch():
    health, _, _ = make()
    source = Source(health)
    gated = health.gate("a", source)
    assert asyncio.run(gated.fetch()) == {"doc": 1}
    source.eject_during_fetch = True
    with pytest.raises(ReplicaEjected):
        asyncio.run(gated.fetch())
    source.eject_during_fetch = False
    with pytest.raises(ReplicaEjected):
        asyncio.run(gated.fetch())


def test_no_state_source_means_unknown_capacity():
    with pytest.raises(StateUnavailable):
        asyncio.run(NoStateSource().fetch())


@pytest.mark.parametrize("table, message", [
    ({"upstream_client": "curl"}, "upstream_client"),
    ({"upstream_client": "httpx"}, "upstream_client"),  # removed: h1 or aiohttp
    ({"read_timeout_s": 0}, "read_timeout_s"),
    ({"connect_timeout_s": True}, "connect_timeout_s"),
    ({"eject_after_failures": 0}, "eject_after_failures"),
    ({"probe_interval_s": "1"}, "probe_interval_s"),
    ({"retries": 2}, "proxy.retries: unknown key"),
])
def test_proxy_table_is_validated(table, message):
    with pytest.raises(ValueError, match=message):
        GuardConfig.from_dict({"proxy": table})


def test_proxy_table_reaches_the_config():
    config = GuardConfig.from_dict({"proxy": {"read_timeout_s": 5, "upstream_client": "aiohttp"}})
    assert config.proxy == ProxyConfig(read_timeout_s=5.0, upstream_client="aiohttp")
    assert GuardConfig().proxy == ProxyConfig()


async def _until(condition) -> None:
    for _ in range(6000):  # hang guard (~30 s), not a timing assertion
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never held")


def test_the_probe_loop_runs_only_while_a_replica_is_ejected_and_again_for_the_next():
    async def main() -> None:
        probed = []

        async def probe(replica_id):
            probed.append(replica_id)
            return True

        health = ReplicaHealth(["a", "b"], 1, 0.001, lambda _rid: None, probe, time.monotonic)
        health.start()
        assert not health.probing  # a healthy fleet: no wake-ups
        assert health.record_failure("a")
        assert health.probing
        await _until(lambda: not health.is_ejected("a"))
        await _until(lambda: not health.probing)  # nothing ejected: the loop ended
        assert health.record_failure("b")  # the next ejection starts it again
        await _until(lambda: not health.is_ejected("b"))
        assert probed == ["a", "b"] and health.num_readmissions == {"a": 1, "b": 1}
        await health.stop()
        assert health.record_failure("a") and not health.probing  # stopped: no new loop

    asyncio.run(main())


class ProbedTransport:
    """What the proxy's probe asks of a transport: a GET, answered from a table by path."""

    def __init__(self, answers):
        self.answers = answers
        self.sent = []

    async def get(self, url, timeout_s, headers=None):
        path = "/" + url.split("/", 3)[3]
        self.sent.append((path, list(headers or ())))
        return self.answers[path], b"{}"

    async def aclose(self):
        pass


@pytest.mark.parametrize(("answers", "back", "asked"), [
    ({"/health": 200}, True, ["/health"]),
    ({"/health": 503}, False, ["/health"]),
    # no /health (llama-cpp-python's server): its model list, with the replica's own key
    ({"/health": 404, "/v1/models": 200}, True, ["/health", "/v1/models"]),
    ({"/health": 404, "/v1/models": 503}, False, ["/health", "/v1/models"]),
])
def test_an_ejected_replica_without_health_is_probed_at_its_model_list(answers, back, asked):
    transport = ProbedTransport(answers)
    app = ProxyApp(GuardConfig.from_dict({"replicas": [
        {"replica_id": "r0", "url": "http://r0:1", "state_source": "none",
         "api_key": "sk-r0"}]}), transport=transport)
    assert asyncio.run(app._probe("r0")) is back
    assert [path for path, _ in transport.sent] == asked
    if "/v1/models" in asked:
        assert transport.sent[1][1] == [(b"authorization", b"Bearer sk-r0")]
