"""The simulated GPU backend: a runner that takes as long as the roofline says a GPU would.

``SimRunner.execute`` prices the step with ``engine.timing_model``, waits until
``step start + predicted × time_scale`` (sleep, then a short spin so Python overhead inside the
step is absorbed and measured durations follow the model), and returns deterministic
pseudo-tokens. ``build_sim_engine`` wires it into an ``LLMEngine`` whose KV pool is the block
count the capacity planner gives for that model on that GPU.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

from engine.config import EngineConfig, model_preset
from engine.gpus import get_gpu
from engine.llm_engine import LLMEngine
from engine.planner import num_kv_blocks
from engine.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.timing_model import StepShape, TimingModel

__all__ = ["SimRunner", "VirtualClock", "build_sim_engine"]

DEFAULT_SPIN_S = 1e-3


class VirtualClock:
    """A clock that moves only when slept on: for running the sim faster than real time."""

    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def sleep(self, duration_s: float) -> None:
        self.now_s += max(duration_s, 0.0)


class SimRunner:
    """Runner protocol implementation backed by a ``TimingModel``.

    Tokens are a pure function of (seed, request id, position), drawn from
    ``[low, high)`` (``high`` ≤ 32,000 keeps clear of Llama-3's special tokens) and never one
    of ``avoid_token_ids`` (EOS) nor the request's ``stop_token_ids``, so every request runs to
    its ``max_tokens``. With a ``VirtualClock``, pass ``spin_s=0``.
    """

    backend = "sim"

    def __init__(self, timing_model: TimingModel, time_scale: float = 1.0, seed: int = 0,
                 vocab_size: int | None = None, avoid_token_ids: tuple[int, ...] = (),
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 spin_s: float = DEFAULT_SPIN_S) -> None:
        if not time_scale >= 0:
            raise ValueError(f"time_scale must be >= 0, got {time_scale}")
        if spin_s < 0:
            raise ValueError(f"spin_s must be >= 0, got {spin_s}")
        self.timing = timing_model
        self.time_scale = float(time_scale)
        self.seed = seed
        self._low, self._high = _token_range(vocab_size or timing_model.model.vocab_size)
        self._avoid = frozenset(avoid_token_ids)
        self._clock, self._sleep, self._spin_s = clock, sleep, spin_s
        self.timing_model = timing_model.as_dict()
        self.num_steps = 0
        self.total_predicted_s = 0.0  # unscaled model time summed over executed steps

    def predict_s(self, scheduler_output: SchedulerOutput) -> float:
        """The unscaled model time of this step."""
        return self.timing.step_s(StepShape.from_scheduler_output(scheduler_output))

    def execute(self, scheduler_output: SchedulerOutput) -> dict[str, int]:
        start_s = self._clock()
        predicted_s = self.predict_s(scheduler_output)
        tokens = {s.request_id: self._token(s) for s in scheduler_output.scheduled if s.samples}
        self.num_steps += 1
        self.total_predicted_s += predicted_s
        self._wait_until(start_s + predicted_s * self.time_scale)
        return tokens

    def _wait_until(self, deadline_s: float) -> None:
        remaining = deadline_s - self._clock()
        if remaining > self._spin_s:
            self._sleep(remaining - self._spin_s)
        while self._clock() < deadline_s:
            if self._spin_s == 0:
                self._sleep(deadline_s - self._clock())
                break

    def _token(self, seq: ScheduledSeq) -> int:
        position = seq.num_computed_tokens + seq.num_new_tokens
        key = f"{self.seed}:{seq.request_id}:{position}".encode()
        value = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        span = self._high - self._low
        blocked = self._avoid | frozenset(seq.params.stop_token_ids)
        token = self._low + value % span
        while token in blocked:
            token = self._low + (token - self._low + 1) % span
        return token


def _token_range(vocab_size: int) -> tuple[int, int]:
    if vocab_size < 4:
        raise ValueError(f"vocab_size must be >= 4, got {vocab_size}")
    high = min(vocab_size, 32_000)
    low = 256 if high > 512 else high // 2
    return low, high


def build_sim_engine(model: str = "llama-7b", gpu: str = "h100-80g", time_scale: float = 1.0,
                     gpu_memory_utilization: float = 0.9, block_size: int = 16,
                     max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                     seed: int = 0, clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], None] = time.sleep,
                     spin_s: float = DEFAULT_SPIN_S,
                     timing_model: TimingModel | None = None, **overrides) -> LLMEngine:
    """An ``LLMEngine`` driving a ``SimRunner``, its KV pool sized by the capacity planner.

    ``overrides`` go to ``EngineConfig.from_model`` (e.g. ``max_model_len``); a ``num_blocks``
    override replaces the planner's block count.
    """
    model_config = model_preset(model)
    gpu_spec = get_gpu(gpu)
    timing = timing_model or TimingModel(model_config, gpu_spec)
    blocks = overrides.pop("num_blocks", None)
    if blocks is not None:
        if blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {blocks}")
    else:
        blocks = num_kv_blocks(model_config, gpu_spec, gpu_memory_utilization,
                               timing.dtype_bytes, block_size, max_num_batched_tokens,
                               max_num_seqs)
    if blocks < 1:
        raise ValueError(f"{model} does not fit on {gpu} at gpu_memory_utilization="
                         f"{gpu_memory_utilization}: no room left for KV blocks")
    config = EngineConfig.from_model(
        model_config, num_blocks=blocks, block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, device="cpu", dtype="bfloat16",
        seed=seed, **overrides)
    runner = SimRunner(timing, time_scale=time_scale, seed=seed,
                       avoid_token_ids=model_config.eos_token_ids, clock=clock, sleep=sleep,
                       spin_s=spin_s)
    return LLMEngine(config, runner=runner, clock=clock)
