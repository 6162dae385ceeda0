"""policies.step_time_fitter: prior, online fit, non-negativity, self-measured error."""

import warnings
from collections import deque

import numpy as np
import pytest

from policies.step_time import StepTimeModel
from policies.step_time_fitter import StepTimeFitter, prior_from_timing_model, roofline_prior

TRUE = StepTimeModel(base_s=0.004, per_prefill_token_s=2e-5, per_decode_seq_s=3e-4,
                     per_context_token_s=1e-7)
PRIOR = StepTimeModel(base_s=0.010, per_prefill_token_s=1e-4, per_decode_seq_s=1e-4,
                      per_context_token_s=1e-6)


def mixed_samples(n, seed=0, noise=0.0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        prefill = int(rng.choice([0, 0, 0, rng.integers(16, 2048)]))
        decode = int(rng.integers(1, 64))
        context = int(decode * rng.integers(10, 2000))
        duration = TRUE.step_s(prefill, decode, context) * (1 + noise * rng.standard_normal())
        yield prefill, decode, context, duration


def test_recovers_known_coefficients_from_exact_samples():
    fitter = StepTimeFitter(PRIOR, window=256, min_samples=16)
    for s in mixed_samples(256):
        fitter.add(*s)
    np.testing.assert_allclose(fitter.model().as_tuple(), TRUE.as_tuple(), rtol=0.02)


def test_recovers_coefficients_with_noise_and_error_shrinks():
    fitter = StepTimeFitter(PRIOR, window=256, min_samples=16)
    for i, s in enumerate(mixed_samples(600, seed=1, noise=0.03)):
        fitter.add(*s)
        if i % 25 == 24:  # a state poll's worth of iterations, then the model is read
            fitter.model()
    fitted = fitter.model()
    for prefill, decode, context in [(0, 8, 4000), (512, 4, 1000), (2000, 32, 30000)]:
        assert fitted.step_s(prefill, decode, context) == pytest.approx(
            TRUE.step_s(prefill, decode, context), rel=0.05)
    error = fitter.prediction_error()
    assert error.num_samples == 256
    assert error.median_abs_rel < 0.05  # the last 256 were predicted by an already-good model


def test_stays_at_prior_with_too_few_samples():
    fitter = StepTimeFitter(PRIOR, min_samples=16)
    assert fitter.model() == PRIOR
    for s in list(mixed_samples(15)):
        fitter.add(*s)
    assert fitter.model() == PRIOR
    fitter.add(*next(mixed_samples(1, seed=9)))
    assert fitter.model() != PRIOR


def test_decode_only_window_keeps_prefill_coefficient_at_prior():
    fitter = StepTimeFitter(PRIOR, window=64, min_samples=16)
    for _prefill, decode, context, _ in mixed_samples(200, seed=2):
        fitter.add(0, decode, context, TRUE.step_s(0, decode, context))
    model = fitter.model()
    assert model.per_prefill_token_s == pytest.approx(PRIOR.per_prefill_token_s)
    assert model.per_decode_seq_s == pytest.approx(TRUE.per_decode_seq_s, rel=0.05)


def test_coefficients_never_negative():
    fitter = StepTimeFitter(PRIOR, window=64, min_samples=16)
    rng = np.random.default_rng(3)
    for _ in range(64):  # duration falls with context: the unconstrained fit would go negative
        context = int(rng.integers(100, 10000))
        decode = int(rng.integers(1, 16))
        fitter.add(0, decode, context, 0.05 - 4e-6 * context + 1e-4 * decode)
    model = fitter.model()
    assert all(c >= 0 for c in model.as_tuple())
    assert model.per_context_token_s == 0.0


def test_refit_is_lazy_and_periodic():
    fitter = StepTimeFitter(PRIOR, window=64, min_samples=16, refit_every=8)
    samples = list(mixed_samples(40))
    for s in samples[:16]:
        fitter.add(*s)
    first = fitter.model()
    for s in samples[16:20]:
        fitter.add(*s)
    assert fitter.model() is first  # fewer than refit_every new samples: the cached model
    for s in samples[20:24]:
        fitter.add(*s)
    assert fitter.model() is not first


def test_a_batch_of_records_costs_at_most_one_refit_and_is_predicted_by_the_model_in_use():
    """A state poll adds its iterations, then reads the model: one fit per poll at most (a
    fit every refit_every records while adding cost ~3 per 100 ms poll), and each record is
    predicted by the model the policy was using, not one refitted half-way through the batch."""
    fitter = StepTimeFitter(PRIOR, window=256, min_samples=16, refit_every=8)
    fits = []
    real_fit = fitter._fit
    fitter._fit = lambda: fits.append(1) or real_fit()
    samples = list(mixed_samples(100, seed=4))
    for s in samples[:40]:
        fitter.add(*s)
    assert fits == []  # adding never fits
    in_use = fitter.model()
    assert len(fits) == 1 and in_use != PRIOR
    for s in samples[40:65]:
        fitter.add(*s)
    expected = [abs(in_use.step_s(p, d, c) - t) / t for p, d, c, t in samples[40:65]]
    assert fitter.prediction_error().num_samples == 65  # reading the error scores them
    assert list(fitter._errors)[-25:] == pytest.approx(expected)
    fitter.model()
    assert len(fits) == 2


def test_by_default_a_refit_waits_for_an_eighth_of_the_window_of_new_records():
    fitter = StepTimeFitter(PRIOR)  # window 256, min_samples 16, refit_every 32
    samples = list(mixed_samples(100, seed=5))
    for s in samples[:16]:
        fitter.add(*s)
    first = fitter.model()
    for s in samples[16:47]:
        fitter.add(*s)
    assert fitter.model() is first  # 31 new records: still the model in use
    fitter.add(*samples[47])
    assert fitter.model() is not first


def test_batch_id_dedupe_and_unusable_samples():
    fitter = StepTimeFitter(PRIOR)
    assert fitter.add(0, 4, 100, 0.01, batch_id=7)
    assert not fitter.add(0, 4, 100, 0.01, batch_id=7)
    assert fitter.num_samples == 1
    assert not fitter.add(0, 0, 0, 0.01)  # an empty step
    assert not fitter.add(0, 4, 100, 0.0)
    assert not fitter.add(0, 4, 100, float("nan"))  # JSON as Python reads it: NaN, Infinity
    assert not fitter.add(0, 4, 100, float("inf"))
    assert fitter.add_many([(0, 4, 100, float("nan")), (0, 4, 100, float("inf"))]) == 0
    assert fitter.num_samples == 1
    fitter.forget_batch_ids()  # replica restart
    assert fitter.add(0, 4, 100, 0.01, batch_id=7)


def test_prediction_error_is_measured_before_fitting():
    fitter = StepTimeFitter(PRIOR, min_samples=16)
    assert fitter.prediction_error() is None
    fitter.add(0, 10, 1000, 0.010)  # prior predicts 0.010 + 0.001 + 0.001 = 0.012
    error = fitter.prediction_error()
    assert error.num_samples == 1
    assert error.median_abs_rel == pytest.approx(0.2)


def test_roofline_prior_reference_model():
    prior = roofline_prior()
    # 14 GB of bf16 weights read at 2 TB/s = 7 ms, plus 2 ms overhead
    assert prior.base_s == pytest.approx(0.009)
    assert prior.per_context_token_s == pytest.approx(131072 / 2.0e12)
    assert prior.per_prefill_token_s == pytest.approx(2 * 7e9 / 156e12)
    assert all(c > 0 for c in prior.as_tuple())


def test_prior_from_timing_model():
    tm = {"base_s": 0.002, "per_prefill_token_s": 1e-5, "per_decode_seq_s": 1e-4,
          "per_context_token_s": 1e-8, "extra": "ignored"}
    assert prior_from_timing_model(tm) == StepTimeModel(0.002, 1e-5, 1e-4, 1e-8)
    scaled = prior_from_timing_model(tm, time_scale=10.0)
    assert scaled.base_s == pytest.approx(0.02)
    assert prior_from_timing_model(None) is None
    assert prior_from_timing_model({"base_s": 0.1}) is None
    assert prior_from_timing_model({**tm, "base_s": -1}) is None


def test_rejects_bad_parameters():
    with pytest.raises(ValueError):
        StepTimeFitter(PRIOR, window=8, min_samples=16)
    with pytest.raises(ValueError):
        StepTimeFitter(PRIOR, refit_every=0)


def test_prior_from_sim_timing_model_nested_shape():
    """The sim backend reports its linear prior under ``step_time_prior``."""
    tm = {"kind": "roofline", "overhead_s": 1e-4,
          "step_time_prior": {"base_s": 0.004, "per_prefill_token_s": 2e-5,
                              "per_decode_seq_s": 1e-5, "per_context_token_s": 1e-8}}
    assert prior_from_timing_model(tm, time_scale=2.0) == StepTimeModel(0.008, 4e-5, 2e-5, 2e-8)


def short_request_window(prior: StepTimeModel, n: int = 256, seed: int = 4):
    """Steps of many short requests (8 output tokens at 200 req/s): small decode batches of
    short contexts, small prefills, and stalls that grow with the batch (the engine's host
    work for requests starting and ending), on an engine whose steps follow ``prior``."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        decode = int(rng.integers(1, 40))
        context = decode * int(rng.integers(20, 45))
        prefill = int(rng.choice([0, 32, 64, 32 * int(rng.integers(1, 22))]))
        stall_s = float(rng.exponential(2e-5)) * decode * (rng.random() < 0.3)
        yield prefill, decode, context, prior.step_s(prefill, decode, context) + stall_s


def test_a_window_of_short_requests_does_not_price_a_burst_of_long_streams_far_off():
    """The terms such a window barely excites (context tokens, the decode batch past ~40) keep
    the prior's price: a step of 54 streams of ~600-token contexts, after it, is forecast near
    what the engine takes (the prior here), not many times it."""
    prior = StepTimeModel(base_s=0.0041, per_prefill_token_s=1.86e-5, per_decode_seq_s=4.2e-6,
                          per_context_token_s=3.9e-8)
    fitter = StepTimeFitter(prior)
    for sample in short_request_window(prior):
        fitter.add(*sample)
    model = fitter.model()
    for shape in [(0, 54, 54 * 600), (2047, 54, 54 * 600), (0, 200, 200 * 400)]:
        assert model.step_s(*shape) == pytest.approx(prior.step_s(*shape), rel=0.3), shape
    for prefill, decode, context, duration_s in short_request_window(prior, 32, seed=5):
        assert model.step_s(prefill, decode, context) == pytest.approx(duration_s, rel=0.3)


class EagerFitter:
    """The fitter as it was: every record scored as it is added, every fit made from the
    whole window's records at once (np.median, np.linalg.solve). The reference for what the
    deferred one must answer."""

    def __init__(self, prior, window=256, min_samples=16, refit_every=32, ridge=3e-5):
        self.prior, self.window, self.min_samples = prior, window, min_samples
        self.refit_every, self.ridge = refit_every, ridge
        self.rows, self.errors = deque(maxlen=window), deque(maxlen=window)
        self.current, self.adds_since_fit = prior, 0

    def add(self, p, d, c, duration_s):
        if duration_s <= 0 or (p <= 0 and d <= 0):
            return False
        self.errors.append(abs(self.current.step_s(p, d, c) - duration_s) / duration_s)
        self.rows.append((float(p), float(d), float(c), float(duration_s)))
        self.adds_since_fit += 1
        return True

    def model(self):
        if len(self.rows) >= self.min_samples and (
                self.adds_since_fit >= self.refit_every or self.current is self.prior):
            self.current, self.adds_since_fit = self.fit(), 0
        return self.current

    def prediction_error(self):
        if not self.errors:
            return None
        errors = np.array(self.errors)
        return (len(errors), float(np.median(errors)), float(np.quantile(errors, 0.9)))

    def fit(self):
        data = np.array(self.rows, dtype=float)
        x = np.column_stack([np.ones(len(data)), data[:, :3]])
        y = data[:, 3]
        prior = np.asarray(self.prior.as_tuple(), dtype=float)
        unit = prior.copy()
        no_prior = prior <= 0
        if no_prior.any():
            rms_x = np.sqrt(np.mean(x * x, axis=0))
            rms_x[rms_x == 0] = 1.0
            unit[no_prior] = np.sqrt(np.mean(y * y)) / rms_x[no_prior]
        prior_s = x @ prior
        ratio = float(np.median(y / prior_s)) if (prior_s > 0).all() else 1.0
        excited = np.any(x != 0, axis=0)
        target = np.where(no_prior, 0.0, np.where(excited, ratio, 1.0))
        xu, lam = x * unit, self.ridge * float(y @ y)
        free = np.ones(4, dtype=bool)
        for _ in range(5):
            w = np.zeros(4)
            xf = xu[:, free]
            gram = xf.T @ xf + lam * np.eye(xf.shape[1])
            w[free] = np.linalg.solve(gram, xf.T @ y + lam * target[free])
            if (w >= 0).all():
                break
            free &= w > 0
        else:
            w = np.maximum(w, 0.0)
        return StepTimeModel(*(float(c) for c in w * unit))


def state_refreshes(seed, n):
    """Batches of iteration records as state refreshes bring them (1 to 40 a refresh):
    mixed prefill and decode, a stretch of short requests, a stretch where the duration falls
    with the context (the non-negativity loop), and unusable records now and then."""
    rng = np.random.default_rng(seed)
    short = list(short_request_window(TRUE, 128, seed=seed))
    falling = [(0, int(d), int(c), 0.05 - 4e-6 * c + 1e-4 * d)
               for d, c in zip(rng.integers(1, 16, 96), rng.integers(100, 10000, 96), strict=True)]
    records = [*mixed_samples(n, seed=seed, noise=0.05), *short, *falling,
               *mixed_samples(n, seed=seed + 1, noise=0.2)]
    for i in rng.choice(len(records), 8, replace=False):
        records[i] = (0, 0, 0, 0.01) if i % 2 else (0, 4, 100, 0.0)
    i = 0
    while i < len(records):
        k = int(rng.integers(1, 41))
        yield records[i:i + k]
        i += k


@pytest.mark.parametrize("prior", [PRIOR, StepTimeModel(0.01, 0.0, 1e-4, 1e-6)],
                         ids=["prior", "a term priced at zero"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_deferred_records_answer_exactly_as_an_eager_fit_at_every_query(prior, seed):
    """Records joined to the window only when the model is next asked for, scored then, and
    fitted on kept arrays: the same model and the same error, to the last bit, wherever
    they are asked for — after every refresh, and with refreshes skipped; added one by one or
    a refresh's at once."""
    lazy, eager = StepTimeFitter(prior), EagerFitter(prior)
    rng = np.random.default_rng(100 + seed)
    num_queries = num_refits = 0
    for batch in state_refreshes(seed, 400):
        if rng.random() < 0.5:  # a refresh's records in one call, as LoadState adds them
            assert lazy.add_many(batch) == sum(eager.add(*record) for record in batch)
        else:
            for record in batch:
                assert lazy.add(*record) == eager.add(*record)
        if rng.random() < 0.8:  # a refresh that reads the model (most; some only add)
            before = eager.current
            assert lazy.model() == eager.model()
            num_queries += 1
            num_refits += eager.current is not before
        if rng.random() < 0.1:
            got = lazy.prediction_error()
            assert (got.num_samples, got.median_abs_rel, got.p90_abs_rel) == \
                eager.prediction_error()
    assert num_queries > 20 and num_refits > 10


def test_records_wait_for_at_most_a_window():
    """Added and never asked for, the records join the window in batches of at most its size:
    nothing grows without bound, and the error still covers the last window."""
    fitter = StepTimeFitter(PRIOR, window=16, min_samples=16)
    for s in mixed_samples(100, seed=6):
        fitter.add(*s)
    assert len(fitter._new) < 16 and len(fitter._data) == 16
    assert fitter.num_samples == 16
    assert fitter.prediction_error().num_samples == 16


def test_add_many_takes_all_records_or_none():
    fitter = StepTimeFitter(PRIOR)
    assert fitter.add_many([(0, 4, 100, 0.01), (0, 0, 0, 0.01), (8, 0, 0, 0.002)]) == 2
    with pytest.raises(OverflowError):
        fitter.add_many([(0, 4, 100, 0.01), (0, 4, 10**400, 0.01)])
    assert fitter.num_samples == 2 and len(fitter._new[3]) == 2  # the durations column


def test_the_small_solve_answers_as_numpy_and_refuses_a_singular_system():
    from policies.step_time_fitter import _solve

    rng = np.random.default_rng(7)
    for _ in range(20):
        a = rng.standard_normal((4, 4))
        gram, b = a.T @ a + 1e-3 * np.eye(4), rng.standard_normal(4)
        assert (_solve(gram, b) == np.linalg.solve(gram, b)).all()
    with warnings.catch_warnings():  # numpy's own warning on the way, if any
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(np.linalg.LinAlgError):
            _solve(np.zeros((4, 4)), np.ones(4))


def test_a_non_finite_duration_leaves_the_fit_as_it_would_be_without_it():
    """One NaN or infinite duration in the window used to zero every coefficient."""
    clean, dirty = StepTimeFitter(PRIOR), StepTimeFitter(PRIOR)
    for i, s in enumerate(mixed_samples(64, seed=8)):
        clean.add(*s)
        dirty.add(*s)
        if i in (10, 40):
            dirty.add(s[0], s[1], s[2], float("nan") if i == 10 else float("inf"))
    assert dirty.model() == clean.model() and clean.model().base_s > 0
