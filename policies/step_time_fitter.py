"""Online fit of the engine step-time model from iteration records.

:class:`StepTimeFitter` starts at a prior (the roofline, or the sim backend's own timing model)
and, once it holds ``min_samples`` iteration records, refits the four coefficients of
:class:`policies.step_time.StepTimeModel` by least squares over a sliding window:

* each coefficient is fitted in units of its prior, and the ridge (``ridge`` × the window's sum
  of squared durations) pulls it toward the prior scaled by the window's median ratio of
  measured to prior step time: a term moves from the prior only as far as the durations it
  explains in the window justify. A coefficient the window never excites (prefill in a window
  of decode-only steps) stays at the prior; one it barely excites, or cannot tell apart from
  another (short requests: context tokens rise with the decode batch), keeps the prior's
  share instead of absorbing the window's noise (fitted freely, a window of short requests can
  price context tokens at ~90x the prior: a burst of long streams after it is then forecast at
  many times its real step time, and shed as ``slo_unattainable`` on an idle replica);
* coefficients are kept non-negative with a small active-set loop (fix a negative one at zero,
  refit the rest).

The fitter also measures itself: each new record is predicted by the model in use at that
moment (the one :meth:`StepTimeFitter.model` last returned, before the record is fitted on), and
the relative errors are kept for export.

Adding a record is cheap: :meth:`StepTimeFitter.add` checks it and appends its four
numbers to four lists (no object per record: at 256 replicas streaming at 10 Hz a tuple per
record was most of what set off Python's cyclic collector, ~0.04 core of collections that
found nothing); :meth:`StepTimeFitter.add_columns` takes a state refresh's records as columns
(a streamed replica's form) and checks them with a few builtins over each list, no Python
step per record. The window is kept as the arrays a fit reads, and the records added since
the last fit join them — and are scored against the model in use, which cannot have changed
since they came — in one vectorised step when the model is next refitted, or when the error is
read. A refit happens in :meth:`StepTimeFitter.model` only, once ``refit_every`` (32) new
records are in, an eighth of the window, and ``refit_span_s`` of engine time (their
durations summed, default 0: the count alone): a fit is a dozen numpy calls run on the event
loop the requests wait on, and the model moves slowly. The span keeps a fast-stepping engine
from costing more fits than a slow one: at 256 replicas that each step every 5–10 ms, 32
records are 0.2–0.3 s and the fits were a tenth of a proxy's CPU for state;
:func:`replica_fitter` (a guard's fitter of a replica, and a replica's fitter of itself for
its state stream: :mod:`serving.step_time_fit`) waits for ``REFIT_SPAN_S`` (1 s) of engine
time, which a replica stepping every 30 ms or more reaches with the 32 records anyway. A batch of records (one
state refresh's iterations) therefore costs at most one fit. The fit computes on the same
arrays, in the same order, with the same operations as one made from the whole window at
once, so its estimates are the same to the last bit
(``tests/policies/test_step_time_fitter.py`` compares it with such a fit at every
query).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from policies.step_time import StepTimeModel

__all__ = ["REFIT_SPAN_S", "PredictionError", "StepTimeFitter", "new_records",
           "prior_from_timing_model", "replica_fitter", "roofline_prior"]

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


# the engine time a replica's fitter waits for between refits (the module docstring)
REFIT_SPAN_S = 1.0


def replica_fitter(prior: StepTimeModel) -> StepTimeFitter:
    """A replica's fitter, starting at ``prior``: the guard's of each replica, and a replica's
    own (:mod:`serving.step_time_fit`), alike, so a fit made at either end is the same."""
    return StepTimeFitter(prior, refit_span_s=REFIT_SPAN_S)


def new_records(iterations: Iterable[Mapping[str, Any]],
                last_batch_id: int) -> tuple[list[tuple[int, int, int, float]], int]:
    """A state document's iteration records (rows) whose batch id is above ``last_batch_id``
    (a replica's ids rise), as :meth:`StepTimeFitter.add_many` takes them, and the last batch
    id now."""
    records = []
    for it in iterations:
        batch_id = int(it["batch_id"])
        if batch_id <= last_batch_id:
            continue
        last_batch_id = batch_id
        records.append((int(it["num_prefill_tokens"]), int(it["num_decode_seqs"]),
                        int(it["num_context_tokens"]), float(it["duration_s"])))
    return records, last_batch_id


@dataclass(frozen=True)
class PredictionError:
    """Relative errors |predicted − actual| / actual of the model in use, on unseen records."""

    num_samples: int
    median_abs_rel: float
    p90_abs_rel: float


class StepTimeFitter:
    """Sliding-window, prior-regularised, non-negative least squares for the step-time model."""

    def __init__(self, prior: StepTimeModel, window: int = 256, min_samples: int = 16,
                 refit_every: int = 32, ridge: float = 3e-5, refit_span_s: float = 0.0):
        if window < 4 or min_samples < 4 or min_samples > window:
            raise ValueError("StepTimeFitter: need 4 <= min_samples <= window")
        if refit_every < 1 or ridge <= 0:
            raise ValueError("StepTimeFitter: refit_every must be >= 1 and ridge > 0")
        if not 0.0 <= refit_span_s < math.inf:
            raise ValueError("StepTimeFitter: refit_span_s must be a finite number >= 0")
        self.prior = prior
        self._window = window
        # the window as a fit reads it, oldest first: rows (prefill, decode, context,
        # duration_s), and x = (1, prefill, decode, context)
        self._data = np.empty((0, 4))
        self._x = np.empty((0, 4))
        self._prior = np.asarray(prior.as_tuple(), dtype=float)
        # records added since they were last joined to the arrays (and not yet scored), as
        # four columns (prefill, decode, context, duration_s): numbers in lists, where a tuple
        # per record would be one more object for Python's cyclic collector to walk until the
        # join (at 256 replicas × 10 Hz most of the objects a state refresh leaves alive)
        self._new: tuple[list[float], list[float], list[float], list[float]] = ([], [], [], [])
        self._num_added = 0
        self._min_samples = min_samples
        self._refit_every = refit_every
        self._refit_span_s = refit_span_s
        self._ridge = ridge
        self._model = prior
        self._adds_since_fit = 0
        self._span_since_fit_s = 0.0  # the durations of the records added since the fit
        self._errors: deque[float] = deque(maxlen=window)
        self._batch_ids: deque[int] = deque(maxlen=4 * window)
        self._batch_id_set: set[int] = set()

    @property
    def num_samples(self) -> int:
        return min(self._num_added, self._window)

    def add(self, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int,
            duration_s: float, batch_id: int | None = None) -> bool:
        """Add one iteration record; False when it was a duplicate batch id or unusable (an
        empty step, or a duration that is not a finite number > 0: one NaN or infinity in the
        window would zero every coefficient of the fit)."""
        if not _usable(num_prefill_tokens, num_decode_seqs, duration_s):
            return False
        if batch_id is not None and not self._remember(batch_id):
            return False
        for column, value in zip(self._new, (num_prefill_tokens, num_decode_seqs,
                                             num_context_tokens, duration_s), strict=True):
            column.append(float(value))
        self._added(1, float(duration_s))
        return True

    def add_many(self, records: Iterable[tuple[int, int, int, float]]) -> int:
        """Add iteration records ``(num_prefill_tokens, num_decode_seqs, num_context_tokens,
        duration_s)`` whose batch ids the caller has already checked (a state refresh's new
        ones); as :meth:`add` each, unusable ones skipped. Returns how many were added."""
        rows = [(float(p), float(d), float(c), float(duration_s))  # all converted, or none
                for p, d, c, duration_s in records
                if _usable(p, d, duration_s)]
        if rows:
            for column, values in zip(self._new, zip(*rows, strict=True), strict=True):
                column.extend(values)
        self._added(len(rows), math.fsum(row[3] for row in rows))
        return len(rows)

    def add_columns(self, num_prefill_tokens: Sequence[float], num_decode_seqs: Sequence[float],
                    num_context_tokens: Sequence[float], duration_s: Sequence[float]) -> int:
        """Add iteration records given as four lists of equal length (a streamed replica's
        columns) whose batch ids the caller has already checked; unusable records (as
        :meth:`add`) skipped. ValueError, adding none, when the lists differ in length or a
        token count is not a number >= 0 (a malformed document). Returns how many were
        added. A handful of builtins check the whole batch; only a batch with an unusable
        record is looked at record by record."""
        p, d, c, y = num_prefill_tokens, num_decode_seqs, num_context_tokens, duration_s
        n = len(y)
        if not len(p) == len(d) == len(c) == n:
            raise ValueError("iteration columns: four lists of equal length expected")
        if not n:
            return 0
        try:
            counts_ok = min(p) >= 0 and min(d) >= 0 and min(c) >= 0 \
                and math.isfinite(sum(p) + sum(d) + sum(c))
            span_s = sum(y)  # NaN or infinite when any duration is
            all_usable = min(y) > 0 and math.isfinite(span_s) and (
                min(d) > 0 or all(a > 0 or b > 0 for a, b in zip(p, d, strict=True)))
        except TypeError:  # a value that is no number
            counts_ok = False
        if not counts_ok:
            raise ValueError("iteration columns: token counts must be numbers >= 0")
        if not all_usable:
            rows = [row for row in zip(p, d, c, y, strict=True)
                    if _usable(row[0], row[1], row[3])]
            p, d, c, y = zip(*rows, strict=True) if rows else ((), (), (), ())
            span_s = math.fsum(y)
        for column, values in zip(self._new, (p, d, c, y), strict=True):
            column.extend(values)  # as sent: _join makes them floats
        self._added(len(y), span_s)
        return len(y)

    def _added(self, count: int, span_s: float) -> None:
        self._num_added += count
        self._adds_since_fit += count
        self._span_since_fit_s += span_s
        if len(self._new[3]) >= self._window:  # never more than a window waits (model() not asked)
            self._join()

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

    def _join(self) -> None:
        """The new records into the window's arrays, each scored by the model in use (the
        model changes only in :meth:`model`, which joins them first)."""
        new, self._new = self._new, ([], [], [], [])
        if not new[3]:
            return
        columns = np.array(new, dtype=float)
        p, d, c, y = columns
        block = columns.T  # the rows, as the window keeps them
        m = self._model  # the same expression, in the same order, as StepTimeModel.step_s
        predicted = m.base_s + m.per_prefill_token_s * p + m.per_decode_seq_s * d \
            + m.per_context_token_s * c
        self._errors.extend((np.abs(predicted - y) / y).tolist())
        window = self._window
        self._data = np.concatenate((self._data, block))[-window:]
        x_new = np.column_stack([np.ones(len(block)), block[:, :3]])
        self._x = np.concatenate((self._x, x_new))[-window:]

    def model(self) -> StepTimeModel:
        """The prior until ``min_samples`` records, then the fit (refreshed once
        ``refit_every`` records and ``refit_span_s`` of their durations are in)."""
        if self._num_added >= self._min_samples and (
            (self._adds_since_fit >= self._refit_every
             and self._span_since_fit_s >= self._refit_span_s)
            or self._model is self.prior
        ):
            self._join()
            self._model = self._fit()
            self._adds_since_fit = 0
            self._span_since_fit_s = 0.0
        return self._model

    def prediction_error(self) -> PredictionError | None:
        self._join()
        if not self._errors:
            return None
        errors = np.fromiter(self._errors, dtype=float)
        return PredictionError(len(errors), float(np.median(errors)),
                               float(np.quantile(errors, 0.9)))

    def _fit(self) -> StepTimeModel:
        x = self._x
        y = self._data[:, 3]  # a column of the rows, as the fit has always read it: the BLAS
        # calls below round a strided vector's sums differently from a contiguous one's
        prior = self._prior
        # each coefficient in units of its prior: the ridge then weighs how far a term moves
        # from the prior against how much of the window's durations that term explains
        unit = prior.copy()
        no_prior = prior <= 0  # a term the prior prices at zero: in units of the whole step
        if no_prior.any():
            rms_x = np.sqrt(np.mean(x * x, axis=0))
            rms_x[rms_x == 0] = 1.0
            unit[no_prior] = np.sqrt(np.mean(y * y)) / rms_x[no_prior]
        # the ridge's target: the prior scaled by how the window's steps compare with it (an
        # engine uniformly slower than its prior); an unexcited column stays at the prior
        prior_s = x @ prior
        ratio = _median(y / prior_s) if (prior_s > 0).all() else 1.0
        excited = x.any(axis=0).tolist()
        target = np.array([0.0 if zero else (ratio if used else 1.0)
                           for zero, used in zip(no_prior.tolist(), excited, strict=True)])
        weights = _nonneg_ridge(x * unit, y, target, self._ridge * float(y @ y))
        return StepTimeModel(*(weights * unit).tolist())


def _usable(num_prefill_tokens: int, num_decode_seqs: int, duration_s: float) -> bool:
    return 0 < duration_s < math.inf and (num_prefill_tokens > 0 or num_decode_seqs > 0)


def _median(values: np.ndarray) -> float:
    """``float(np.median(values))`` of a 1-d array it may reorder, without np.median's
    general-purpose overhead: the same partition and the same arithmetic (the mean of the two
    middle values, NaN when any value is NaN)."""
    n = len(values)
    half = n // 2
    kth = [half - 1, half, n - 1] if n % 2 == 0 else [half, n - 1]
    values.partition(kth)
    if np.isnan(values[-1]):
        return float("nan")
    if n % 2:
        return float(values[half])
    return float((values[half - 1] + values[half]) / 2)


def _nonneg_ridge(x: np.ndarray, y: np.ndarray, target: np.ndarray, lam: float) -> np.ndarray:
    """argmin ||x w − y||² + lam ||w − target||² subject to w >= 0 (small active-set loop)."""
    free = np.ones(x.shape[1], dtype=bool)
    w = np.zeros(x.shape[1])
    for _ in range(x.shape[1] + 1):
        w = np.zeros(x.shape[1])
        xf = x[:, free]
        gram = xf.T @ xf
        gram.flat[::gram.shape[0] + 1] += lam  # + lam × identity
        w[free] = _solve(gram, xf.T @ y + lam * target[free])
        if (w >= 0).all():
            return w
        free &= w > 0
    return np.maximum(w, 0.0)


def _solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``np.linalg.solve(a, b)`` for a small float64 system: the same LAPACK call without the
    wrapper's checks, which cost many times the 4x4 solve itself; a singular ``a`` (a
    non-finite answer, with numpy's warning) goes to ``np.linalg.solve``, which raises
    ``LinAlgError`` for it. The ridge keeps the fit's systems regular."""
    if _SOLVE1 is not None:
        w = _SOLVE1(a, b, signature="dd->d")
        if np.isfinite(w).all():
            return w
    return np.linalg.solve(a, b)


# the gufunc np.linalg.solve calls for one right-hand side (numpy's private module: looked up
# once, np.linalg.solve itself where it is missing)
_SOLVE1 = getattr(getattr(np.linalg, "_umath_linalg", None), "solve1", None)
