"""``kvguard bench shed-cost`` measures what it says: every timed request is a 503 shed."""

import asyncio

from chaos.bench.shed_cost import measure


def test_every_timed_request_is_shed():
    result = asyncio.run(measure(50))
    assert result["statuses"] == {(503, "no_kv_capacity"): 50}  # the policy's own no
    assert result["cpu_us_per_shed"] > 0 and result["profile"] is None
