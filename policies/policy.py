"""The policy protocol every admission algorithm implements.

A policy whose ``observe`` ignores its sample may say so with a class attribute
``observes_completions = False``; the guard then skips building the
:class:`~policies.decision.CompletionSample` on every release. Absent, it counts as true.
"""

from __future__ import annotations

from typing import Protocol

from policies.cost import RequestCost
from policies.decision import CompletionSample, Decision
from policies.snapshot import LoadSnapshot

__all__ = ["Policy"]


class Policy(Protocol):
    name: str

    def decide(self, cost: RequestCost, snapshot: LoadSnapshot) -> Decision:
        """Pure: no I/O, no clock reads. Time is ``snapshot.now_s``."""
        ...

    def admitted(self, cost: RequestCost, replica_id: str, now_s: float) -> None:
        """The guard enforced an Admit for ``cost`` (counting policies track their permits)."""
        ...

    def observe(self, sample: CompletionSample) -> None:
        """A request admitted by this policy ended (success, error or disconnect)."""
        ...
