"""Fault plans against a recording stand-in topology, on an injected clock (no sleeping)."""

import asyncio

import pytest

from chaos.faults import Fault, inject, scaled, validate_plan


class FakeChild:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def kill(self):
        self.log.append((self.name, "kill"))

    def stop(self):
        self.log.append((self.name, "stop"))

    def cont(self):
        self.log.append((self.name, "cont"))

    def restart(self):
        self.log.append((self.name, "restart"))


class FakeTopology:
    def __init__(self, num_replicas=2, num_proxies=1, redis=True):
        self.log = []
        self.replicas = [FakeChild(f"replica-{i}", self.log) for i in range(num_replicas)]
        self.proxies = [FakeChild(f"proxy-{i}", self.log) for i in range(num_proxies)]
        self.redis = FakeChild("redis", self.log) if redis else None


def test_every_fault_acts_then_recovers_and_is_recorded_in_time_order():
    topo = FakeTopology()
    plan = [Fault("replica_kill", 1.0, 2.0, 1), Fault("redis_hang", 0.5, 1.0),
            Fault("proxy_kill", 2.0), Fault("rate_step", 0.2, 3.0)]
    events = asyncio.run(inject(plan, topo, t0_s=0.0, clock=lambda: 100.0))
    assert sorted(topo.log) == sorted([("replica-1", "kill"), ("replica-1", "restart"),
                                       ("redis", "stop"), ("redis", "cont"), ("proxy-0", "kill")])
    assert topo.log.index(("replica-1", "kill")) < topo.log.index(("replica-1", "restart"))
    actions = [(e.target, e.action) for e in events]
    assert ("replica-1", "healthy") in actions and ("rate", "rate up") in actions
    assert ("rate", "rate down") in actions and ("proxy-0", "restart") not in actions
    assert [e.t_s for e in events] == sorted(e.t_s for e in events)


def test_a_failed_action_is_recorded_not_raised():
    topo = FakeTopology()

    def boom():
        raise RuntimeError("not running")

    topo.replicas[0].kill = boom
    events = asyncio.run(inject([Fault("replica_kill", 0.0, 1.0, 0)], topo, 0.0, lambda: 5.0))
    assert [e.action for e in events] == ["kill", "failed"]
    assert "not running" in events[1].detail and topo.log == []   # no restart after a failure


def test_plan_must_name_processes_the_topology_runs():
    with pytest.raises(ValueError, match="redis"):
        validate_plan([Fault("redis_kill", 1.0)], FakeTopology(redis=False))
    with pytest.raises(ValueError, match="replica-3"):
        validate_plan([Fault("replica_hang", 1.0, 1.0, 3)], FakeTopology())
    validate_plan([Fault("rate_step", 1.0, 1.0)], FakeTopology(0, 0, False))


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="meteor", at_s=1.0), "kind"),
    (dict(kind="replica_kill", at_s=-1.0), "at_s"),
    (dict(kind="replica_hang", at_s=1.0), "duration_s"),
    (dict(kind="rate_step", at_s=1.0, duration_s=0.0), "duration_s"),
])
def test_bad_faults_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Fault(**kwargs)


def test_scaled_stretches_times_only():
    f = scaled(Fault("replica_kill", 2.0, 3.0, 1), 2.5)
    assert (f.at_s, f.duration_s, f.target, f.end_s) == (5.0, 7.5, 1, 12.5)
    assert scaled(Fault("proxy_kill", 2.0), 2.0).duration_s is None


def test_a_late_fault_keeps_its_full_length():
    """The loop woke 10 s late for the SIGSTOP: the SIGCONT still comes 2 s after it."""
    topo = FakeTopology()
    now = {"t": 10.0}

    async def fake_sleep(delay_s):
        now["t"] += delay_s

    events = asyncio.run(inject([Fault("redis_hang", 1.0, 2.0)], topo, 0.0,
                                clock=lambda: now["t"], sleep=fake_sleep))
    assert [(e.action, e.t_s) for e in events] == [("stop", 10.0), ("cont", 12.0)]


def test_kill_hot_strikes_the_replica_the_probe_names_when_it_strikes():
    topo = FakeTopology(num_replicas=4)
    asked = []

    async def hottest():
        asked.append(True)
        return 2

    events = asyncio.run(inject([Fault("replica_kill_hot", 1.0, 2.0)], topo, 0.0,
                                lambda: 100.0, hot_replica=hottest))
    assert asked == [True]
    assert topo.log == [("replica-2", "kill"), ("replica-2", "restart")]
    assert [(e.target, e.action) for e in events] == [("replica-2", "kill"),
                                                      ("replica-2", "restart"),
                                                      ("replica-2", "healthy")]
