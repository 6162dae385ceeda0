"""Online fit of the engine step-time model from iteration records.

:class:`StepTimeFitter` starts at a prior (the roofline, or the sim backend's own timing model)
and, once it holds ``min_samples`` iteration records, refits the four coefficients of
:class:`policies.step_time.StepTimeModel` by least squares over a sliding window:

* each feature column is scaled to unit RMS over the window, so one ridge weight fits all;
* the ridge pulls toward the prior, so a coefficient the window never excites (e.g. prefill in a
  window of decode-only steps) stays at the prior instead of collapsing to zero;
* coefficients are kept non-negative with a small active-set loop (fix a negative one at zero,
  refit the rest).

The fitter also measures itself: each new record is first predicted by the model in use at that
moment (the one :meth:`StepTimeFitter.model` last returned, before the record is fitted on), and
the relative errors are kept for export.

Refits happen in :meth:`StepTimeFitter.model` only, so a batch of records (one state poll's
iterations: ~25 of them for a 100 ms poll of a replica stepping every 4 ms) costs at most one
fit, not one every ``refit_every`` records while they are added; and only once ``refit_every``
(32) new records are in, an eighth of the window: a fit is ~10 numpy calls run on the event
loop the requests wait on, and the model moves slowly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from policies.step_time import StepTimeModel

__all__ = ["PredictionError", "StepTimeFitter", "prior_from_timing_model", "roofline_prior"]

_FIELDS = ("base_s", "per_prefill_token_s", "per_decode_seq_s", "per_context_token_s")


def roofline_prior(
    num_params: float = 7e9,
    bytes_per_param: float = 2.0,
    kv_bytes_per_token: float = 131072.0,
    mem_bandwidth_bytes_per_s: float = 2.0e12,
    peak_flops: float = 312e12,
    mfu_ratio: float = 0.5,
    overhead_s: float = 0.002,
) -> StepTimeModel:
    """A step-time prior from the roofline of a generic replica.

    Defaults: the reference model (7 B parameters, bf16, 128 KiB of KV per token) on an
    A100-80GB-class GPU (≈2.0 TB/s HBM, 312 TFLOPS dense bf16, from NVIDIA's A100 datasheet).
    Each step reads all weights once (``base_s``), each cached token's KV once
    (``per_context_token_s``); every prefill token costs ``2 × params`` FLOPs at ``mfu_ratio``
    of peak; a decode sequence costs the same FLOPs, which hide under the weight read until the
    batch is large (kept small here: ``2 × params / peak``).
    """
    weight_read_s = num_params * bytes_per_param / mem_bandwidth_bytes_per_s
    return StepTimeModel(
        base_s=overhead_s + weight_read_s,
        per_prefill_token_s=2.0 * num_params / (peak_flops * mfu_ratio),
        per_decode_seq_s=2.0 * num_params / peak_flops,
        per_context_token_s=kv_bytes_per_token / mem_bandwidth_bytes_per_s,
    )


def prior_from_timing_model(timing_model: Mapping[str, Any] | None,
                            time_scale: float = 1.0) -> StepTimeModel | None:
    """The prior given by a replica's ``/kvguard/state`` ``timing_model``, or None.

    Expects the four :class:`StepTimeModel` coefficient names (seconds, unscaled), at the top
    level or under ``step_time_prior`` (as the sim backend reports them); the result is
    multiplied by ``time_scale`` so it predicts the durations the replica reports.
    """
    if not isinstance(timing_model, Mapping):
        return None
    nested = timing_model.get("step_time_prior")  # the sim backend nests its linear prior
    if isinstance(nested, Mapping):
        timing_model = nested
    values = [timing_model.get(name) for name in _FIELDS]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in values):
        return None
    if not (isinstance(time_scale, (int, float)) and time_scale > 0):
        return None
    return StepTimeModel(*(float(v) * time_scale for v in values))


@dataclass(frozen=True)
class PredictionError:
    """Relative errors |predicted − actual| / actual of the model in use, on unseen records."""

    num_samples: int
    median_abs_rel: float
    p90_abs_rel: float


class StepTimeFitter:
    """Sliding-window, prior-regularised, non-negative least squares for the step-time model."""

    def __init__(self, prior: StepTimeModel, window: int = 256, min_samples: int = 16,
                 refit_every: int = 32, ridge: float = 1e-4):
        if window < 4 or min_samples < 4 or min_samples > window:
            raise ValueError("StepTimeFitter: need 4 <= min_samples <= window")
        if refit_every < 1 or ridge <= 0:
            raise ValueError("StepTimeFitter: refit_every must be >= 1 and ridge > 0")
        self.prior = prior
        self._rows: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self._min_samples = min_samples
        self._refit_every = refit_every
        self._ridge = ridge
        self._model = prior
        self._adds_since_fit = 0
        self._errors: deque[float] = deque(maxlen=window)
        self._batch_ids: deque[int] = deque(maxlen=4 * window)
        self._batch_id_set: set[int] = set()

    @property
    def num_samples(self) -> int:
        return len(self._rows)

    def add(self, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int,
            duration_s: float, batch_id: int | None = None) -> bool:
        """Add one iteration record; False when it was a duplicate batch id or unusable."""
        if duration_s <= 0 or (num_prefill_tokens <= 0 and num_decode_seqs <= 0):
            return False
        if batch_id is not None and not self._remember(batch_id):
            return False
        # the model in use (no refit here: model() does that, once per batch of records)
        predicted_s = self._model.step_s(num_prefill_tokens, num_decode_seqs, num_context_tokens)
        self._errors.append(abs(predicted_s - duration_s) / duration_s)
        self._rows.append((float(num_prefill_tokens), float(num_decode_seqs),
                           float(num_context_tokens), float(duration_s)))
        self._adds_since_fit += 1
        return True

    def forget_batch_ids(self) -> None:
        """The replica restarted: its batch ids start over."""
        self._batch_ids.clear()
        self._batch_id_set.clear()

    def _remember(self, batch_id: int) -> bool:
        if batch_id in self._batch_id_set:
            return False
        if len(self._batch_ids) == self._batch_ids.maxlen:
            self._batch_id_set.discard(self._batch_ids[0])
        self._batch_ids.append(batch_id)
        self._batch_id_set.add(batch_id)
        return True

    def model(self) -> StepTimeModel:
        """The prior until ``min_samples`` records, then the fit (refreshed every few adds)."""
        if len(self._rows) >= self._min_samples and (
            self._adds_since_fit >= self._refit_every or self._model is self.prior
        ):
            self._model = self._fit()
            self._adds_since_fit = 0
        return self._model

    def prediction_error(self) -> PredictionError | None:
        if not self._errors:
            return None
        errors = np.fromiter(self._errors, dtype=float)
        return PredictionError(len(errors), float(np.median(errors)),
                               float(np.quantile(errors, 0.9)))

    def _fit(self) -> StepTimeModel:
        rows = self._rows  # fromiter over the flat values: half the time of asarray's discovery
        data = np.fromiter(chain.from_iterable(rows), dtype=float, count=4 * len(rows))
        data = data.reshape(len(rows), 4)
        x = np.column_stack([np.ones(len(data)), data[:, :3]])
        y = data[:, 3]
        prior = np.asarray(self.prior.as_tuple(), dtype=float)
        scale = np.sqrt(np.mean(x * x, axis=0))
        scale[scale == 0] = 1.0  # an unexcited column: its coefficient stays at the prior
        coef = _nonneg_ridge(x / scale, y, prior * scale, self._ridge * len(y))
        return StepTimeModel(*(float(c) for c in coef / scale))


def _nonneg_ridge(x: np.ndarray, y: np.ndarray, target: np.ndarray, lam: float) -> np.ndarray:
    """argmin ||x w − y||² + lam ||w − target||² subject to w >= 0 (small active-set loop)."""
    free = np.ones(x.shape[1], dtype=bool)
    w = np.zeros(x.shape[1])
    for _ in range(x.shape[1] + 1):
        w = np.zeros(x.shape[1])
        xf = x[:, free]
        gram = xf.T @ xf + lam * np.eye(xf.shape[1])
        w[free] = np.linalg.solve(gram, xf.T @ y + lam * target[free])
        if (w >= 0).all():
            return w
        free &= w > 0
    return np.maximum(w, 0.0)
