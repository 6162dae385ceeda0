"""The Envoy + ``kvguard epp`` tests' shared fixtures: a module's own 2-replica sim fleet, its
guard config, and an HTTP client (each module builds its fleet afresh: module scope)."""

import httpx
import pytest
from epp_helpers import CONFIG, REPLICA_ARGS, write_config

from chaos.topology import Topology, TopologySpec


@pytest.fixture(scope="module")
def fleet():
    with Topology(TopologySpec(num_replicas=2, replica_args=REPLICA_ARGS)) as topology:
        yield topology


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return write_config(tmp_path_factory, CONFIG, "guard.toml")


@pytest.fixture
def client():
    with httpx.Client(timeout=60.0, trust_env=False) as c:
        yield c
