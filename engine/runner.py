"""The runner protocol: what turns a SchedulerOutput into sampled tokens.

The torch ``ModelRunner`` and the simulated ``SimRunner`` both satisfy it, so ``LLMEngine``
drives either one.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from engine.scheduler_output import SchedulerOutput

__all__ = ["Runner"]


@runtime_checkable
class Runner(Protocol):
    """Executes one step.

    ``execute`` computes K/V for every scheduled token (writing them into the KV blocks named
    by each sequence's ``block_ids``) and returns ``{request_id: token_id}`` for exactly the
    scheduled sequences with ``samples=True``. It must not mutate the SchedulerOutput.
    The engine measures the wall time of ``execute`` as the iteration's ``duration_s``.

    Optional attributes the engine reads for ``state()``: ``backend`` (str, e.g. "torch" or
    "sim"), ``timing_model`` (JSON-able dict or None), ``time_scale`` (float).
    """

    def execute(self, scheduler_output: SchedulerOutput) -> dict[str, int]: ...
