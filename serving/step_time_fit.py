"""A replica's step-time fit of itself, published on its state stream (``fit=1``).

A guard learns each replica's step time (:class:`policies.step_time.StepTimeModel`) by fitting
the iteration samples the replica reports (:class:`policies.step_time_fitter.StepTimeFitter`).
At fleet scale that fit, and the samples it reads, were most of what a proxy spent on state:
a replica decoding a small batch steps every ~5 ms, so each 10 Hz event carried ~20 samples
(most of its bytes) and each replica cost the proxy a refit a second. The replica holds the
same samples, and one fit of itself serves every guard that streams its state:

* :class:`StepTimeFit` is the replica's side: fed each compact state document (the samples
  it keeps, new ones found by batch id as a guard finds them), it keeps one
  :func:`policies.step_time_fitter.replica_fitter` — the guard's settings, from the prior the
  guard would take (the document's ``timing_model`` × ``time_scale``, else the roofline
  prior) — and publishes its model as the document's ``step_time_fit`` field. The field is
  a new object only when the model changed (a refit, about once a second), so a stream's
  delta carries it in ``set`` only then.
* :func:`fitted_model` is the guard's side: the field checked (four finite numbers >= 0)
  and made a model (ValueError otherwise: the guard counts the replica's error and changes
  nothing).

With one stream, the model a guard reads is the one its own fitter would have made from the
same samples, to the last bit: the same fitter, fed the same samples at the same events (the
tests compare them). One fit shared by several streams refits on the same rule at whichever
stream's event comes first, so their models are fits of the same samples at slightly
different moments.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from policies.step_time import StepTimeModel
from policies.step_time_fitter import (
    new_records,
    prior_from_timing_model,
    replica_fitter,
    roofline_prior,
)

__all__ = ["FIT_FIELDS", "StepTimeFit", "fitted_model"]

# the published coefficients (StepTimeModel's fields, seconds), in its order
FIT_FIELDS = ("base_s", "per_prefill_token_s", "per_decode_seq_s", "per_context_token_s")


class StepTimeFit:
    """One replica's fit of its own step time, for its state streams (shared by them)."""

    def __init__(self) -> None:
        self._fitter = None  # made at the first document (its prior is the document's)
        self._last_batch_id = -1  # the newest sample fed
        self._last_step_count = -1
        self._model: StepTimeModel | None = None
        self._published: dict[str, Any] = {}

    def update(self, compact: Mapping[str, Any]) -> dict[str, Any]:
        """Feed ``compact``'s samples not fed before (batch ids rise; a step count lower
        than the last one is a restart: they start over), and return the fit to publish:
        the same dict until the model changes."""
        if self._fitter is None:
            self._fitter = replica_fitter(prior_from_timing_model(
                compact.get("timing_model"), compact.get("time_scale", 1.0)) or roofline_prior())
        step_count = int(compact.get("step_count", -1))
        last = self._last_batch_id
        if 0 <= step_count < self._last_step_count:  # the engine restarted: ids start over
            last = -1
        records, last = new_records(compact.get("iterations") or (), last)
        self._last_batch_id, self._last_step_count = last, step_count
        self._fitter.add_many(records)
        model = self._fitter.model()
        if model is not self._model:
            self._model = model
            self._published = {**dict(zip(FIT_FIELDS, model.as_tuple(), strict=True)),
                               "num_samples": self._fitter.num_samples}
        return self._published


def fitted_model(fit: Any) -> StepTimeModel:
    """A published ``step_time_fit`` as a model; ValueError unless it is an object whose four
    coefficients are finite numbers >= 0."""
    if not isinstance(fit, Mapping):
        raise ValueError(f"step_time_fit: an object expected, got {type(fit).__name__}")
    values = []
    for name in FIT_FIELDS:
        value = fit.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0:
            raise ValueError(f"step_time_fit.{name}: a finite number >= 0, got {value!r}")
        values.append(float(value))
    return StepTimeModel(*values)
