"""The coefficient-wise mean of the healthy replicas' step-time models, kept as they change.

The snapshot's ``step_time`` is the mean of every healthy replica's fitted model. Recomputed on
each state refresh it costs O(replicas) per refresh, O(replicas²) per second for the fleet; kept
as running sums, one replica's refresh costs O(1). Running sums drift by rounding, so every
``resync_every`` changes they are summed again from the models themselves.
"""

from __future__ import annotations

from policies.step_time import StepTimeModel

__all__ = ["MeanStepTime"]


class MeanStepTime:
    """Running sums of the counted replicas' model coefficients."""

    def __init__(self, resync_every: int = 1024) -> None:
        if isinstance(resync_every, bool) or not isinstance(resync_every, int) \
                or resync_every < 1:
            raise ValueError(f"resync_every must be an int >= 1, got {resync_every!r}")
        self._resync_every = resync_every
        self._models: dict[str, tuple[float, ...]] = {}
        self._sums: list[float] | None = None
        self._num_changes = 0

    def __len__(self) -> int:
        return len(self._models)

    def count(self, replica_id: str, model: StepTimeModel | None) -> None:
        """``replica_id``'s model now (None: not counted, e.g. unhealthy). The same model
        again (most refreshes: a replica's model moves at its refits, about once a second) is
        no change: the sums stand, untouched by a rounding step."""
        new = model.as_tuple() if model is not None else None
        if self._models.get(replica_id) == new:
            return
        old = self._models.pop(replica_id, None)
        if new is not None:
            self._models[replica_id] = new
        self._num_changes += 1
        sums = self._sums
        if sums is None or self._num_changes % self._resync_every == 0:
            self._sums = None  # summed again at the next mean()
            return
        if old is not None and new is not None:  # a refresh: one pass, (s - old) + new
            self._sums = [s - x + y for s, x, y in zip(sums, old, new, strict=True)]
        elif old is not None:
            self._sums = [s - x for s, x in zip(sums, old, strict=True)]
        elif new is not None:
            self._sums = [s + x for s, x in zip(sums, new, strict=True)]

    def sum_up(self) -> None:
        """Sum the coefficients again from the models where the running sums were let go (at
        the start, after every ``resync_every`` changes); :meth:`count` then moves them. When
        this runs decides the sums' rounding: a caller that wants the same mean from the same
        changes calls it at the same points (the load state: after every refresh at scale,
        and at :meth:`mean`)."""
        if self._sums is None and self._models:
            self._sums = [sum(c) for c in zip(*self._models.values(), strict=True)]

    def mean(self, default: StepTimeModel) -> StepTimeModel:
        """The mean model; ``default`` when no replica is counted."""
        num = len(self._models)
        if not num:
            return default
        self.sum_up()
        return StepTimeModel(*(s / num for s in self._sums))
