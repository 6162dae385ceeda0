"""LLMEngine: requests in, one scheduled batch per ``step()``, tokens out.

Thread-safe: every public method holds one lock, so a server may call ``add_request`` and
``abort_request`` from other threads while a loop thread calls ``step()``; an abort waits at
most for the step in flight and frees the request's blocks before it returns.

KV-cache events (``engine.kv_events``) are recorded only once a sink is attached
(``attach_kv_event_sink``); each step's events go to the sink in one batch after the step.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from typing import Any

from engine.block_hash import HASH_VERSION
from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig, model_preset
from engine.kv_events import KVCacheEvent
from engine.outputs import IterationRecord, RequestOutput, RequestWork, StepResult
from engine.runner import Runner
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus

__all__ = ["LLMEngine"]


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: Runner | None = None, tokenizer: Any = None,
                 state_dict: dict | None = None, clock: Callable[[], float] = time.monotonic,
                 detokenize: Callable[[list[int]], str] | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._clock = clock
        num_blocks = config.num_kv_blocks(_default_kv_budget_bytes(config, runner))
        self.block_manager = BlockManager(num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching, config.model.name)
        if detokenize is None and tokenizer is not None and hasattr(tokenizer, "decode"):
            detokenize = tokenizer.decode
        eos = tuple(config.model.eos_token_ids)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, eos, detokenize)
        self.runner = runner if runner is not None else self._build_runner(state_dict)
        self._lock = threading.RLock()
        self._order = 0
        self._step_count = 0
        self._iterations: collections.deque[IterationRecord] = collections.deque(
            maxlen=config.num_iteration_records)
        self._pending_outputs: list[RequestOutput] = []
        self._kv_event_sink: Callable[[list[KVCacheEvent]], None] | None = None
        self._kv_events_endpoint: str | None = None
        self._kv_events_replay_endpoint: str | None = None

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, runner: Runner | None = None, tokenizer: Any = None,
                    clock: Callable[[], float] = time.monotonic, **overrides) -> LLMEngine:
        """E.g. ``LLMEngine.from_preset("tiny", device="cpu", num_blocks=64)``. Overrides name
        fields of EngineConfig / CacheConfig / SchedulerConfig / ModelConfig."""
        model = model_preset(name)
        state_dict = None
        if model.weights == "smollm2-gguf":
            if runner is None:
                model, state_dict = _load_smollm2(model)
            if tokenizer is None:
                tokenizer = _load_smollm2_tokenizer()
        config = EngineConfig.from_model(model, **overrides)
        return cls(config, runner=runner, tokenizer=tokenizer, state_dict=state_dict, clock=clock)

    def _build_runner(self, state_dict: dict | None) -> Runner:
        import torch

        from engine.model import LlamaModel, random_state_dict
        from engine.model_runner import ModelRunner

        device = torch.device(self.config.resolved_device())
        dtype = ModelRunner.torch_dtype(self.config.resolved_dtype())
        if state_dict is None:
            if self.config.model.weights != "random":
                raise ValueError(f"model {self.config.model.name} needs a state_dict")
            state_dict = random_state_dict(self.config.model, self.config.seed, dtype=dtype,
                                           device=device)
        model = LlamaModel(self.config.model, state_dict, device, dtype)
        return ModelRunner(model, self.block_manager.num_total_blocks,
                           self.config.cache.block_size, seed=self.config.seed)

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: SequenceABC[int],
                    params: SamplingParams, priority: int = 0,
                    arrival_s: float | None = None, cache_salt: str | None = None) -> None:
        """Queue a request. Raises ValueError (engine unchanged) if it can never be served.
        Requests share cached prefix blocks only when their ``cache_salt`` is equal."""
        with self._lock:
            prompt = self._validate(request_id, prompt_token_ids, params, priority)
            if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
                raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
            arrival = self._clock() if arrival_s is None else float(arrival_s)
            self._order += 1
            self.scheduler.add(Sequence(request_id, prompt, params, priority, arrival, self._order,
                                        cache_salt=cache_salt))

    def _validate(self, request_id: str, prompt_token_ids, params, priority) -> tuple[int, ...]:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if self.scheduler.get(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        prompt = tuple(prompt_token_ids)
        if not prompt:
            raise ValueError("prompt_token_ids is empty")
        vocab = self.config.model.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt_token_ids must be ints in [0, {vocab})")
        max_len = self.config.max_model_len
        if len(prompt) >= max_len:
            raise ValueError(f"prompt has {len(prompt)} tokens; max_model_len is {max_len}")
        if len(prompt) + params.max_tokens > max_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len ({max_len})")
        need = self.block_manager.num_blocks_for(len(prompt) + params.max_tokens)
        if need > self.block_manager.num_total_blocks:
            raise ValueError(f"request needs {need} KV blocks; the pool has "
                             f"{self.block_manager.num_total_blocks}")
        return prompt

    def abort_request(self, request_id: str) -> bool:
        """Abort in any state; frees its blocks now. The next ``step()`` reports it finished
        with reason "abort". False if the id is unknown or already finished."""
        with self._lock:
            seq = self.scheduler.abort(request_id)
            if seq is None:
                return False
            self._pending_outputs.append(self._output(seq, (), batch_id=-1))
            return True

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return self.scheduler.has_unfinished()

    # ---- stepping -----------------------------------------------------------------------
    def step(self) -> StepResult:
        with self._lock:
            sched_out = self.scheduler.schedule()
            outputs, self._pending_outputs = self._pending_outputs, []
            if sched_out.is_empty:
                return StepResult(outputs=tuple(outputs), iteration=None)
            preempted_before = self._preempted(sched_out)
            start_s = self._clock()
            sampled = self.runner.execute(sched_out)
            end_s = self._clock()
            results = self.scheduler.update(sched_out, sampled)
            record = IterationRecord(
                batch_id=sched_out.batch_id, num_prefill_tokens=sched_out.num_prefill_tokens,
                num_decode_seqs=sched_out.num_decode_seqs,
                num_context_tokens=sched_out.num_context_tokens,
                duration_s=end_s - start_s, end_s=end_s)
            self._iterations.append(record)
            self._step_count += 1
            outputs += [self._output(seq, toks, sched_out.batch_id, start_s, end_s)
                        for seq, toks in results]
            if self.config.check_invariants:
                self.check_invariants()
            self._publish_kv_events()
            scheduled_ids = tuple(e.request_id for e in sched_out.scheduled)
            return StepResult(outputs=tuple(outputs), iteration=record,
                              scheduled_request_ids=scheduled_ids,
                              work=self._work(sched_out, preempted_before), start_s=start_s)

    def _preempted(self, sched_out) -> dict[str, int]:
        """Scheduled requests that have lost their KV to a preemption at least once, each with
        the number of tokens it knew before this step (all computed once, except the last)."""
        found = (self.scheduler.get(s.request_id) for s in sched_out.scheduled if not s.is_decode)
        return {q.request_id: q.num_tokens for q in found if q is not None and q.num_preemptions}

    @staticmethod
    def _work(sched_out, preempted_before: dict[str, int]) -> tuple[RequestWork, ...]:
        """Each scheduled request's tokens this step. A preempted request recomputes the
        positions it had computed before: every known token but the last sampled one."""
        work = []
        for s in sched_out.scheduled:
            decode = s.is_decode
            prefill = 0 if decode else s.num_new_tokens
            known = preempted_before.get(s.request_id)
            recomputed = 0 if known is None else max(
                0, min(s.num_computed_tokens + prefill, known - 1) - s.num_computed_tokens)
            work.append(RequestWork(s.request_id, prefill, int(decode), s.num_computed_tokens,
                                    recomputed))
        return tuple(work)

    @staticmethod
    def _output(seq: Sequence, new_token_ids: tuple[int, ...], batch_id: int,
                step_start_s: float | None = None,
                step_end_s: float | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=new_token_ids,
            finished=seq.status.finished, finish_reason=seq.status.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens, batch_id=batch_id,
            step_start_s=step_start_s, step_end_s=step_end_s)

    def check_invariants(self) -> None:
        with self._lock:
            self.scheduler.check_invariants()

    # ---- prefix cache -------------------------------------------------------------------
    def attach_kv_event_sink(self, sink: Callable[[list[KVCacheEvent]], None],
                             endpoint: str | None = None,
                             replay_endpoint: str | None = None) -> None:
        """Start recording KV events; ``sink`` receives each step's events (engine thread).
        ``endpoint`` and ``replay_endpoint`` are advertised in ``state()`` as
        ``kv_events_endpoint`` and ``kv_events_replay_endpoint``."""
        with self._lock:
            self._kv_event_sink, self._kv_events_endpoint = sink, endpoint
            self._kv_events_replay_endpoint = replay_endpoint
            if self.block_manager.pool.events is None:
                self.block_manager.pool.events = []

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (emits AllBlocksCleared); False while a block is held."""
        with self._lock:
            done = self.block_manager.reset_prefix_cache()
            self._publish_kv_events()
            return done

    def _publish_kv_events(self) -> None:
        events = self.block_manager.take_events()
        if events and self._kv_event_sink is not None:
            self._kv_event_sink(events)

    # ---- introspection ------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_total_blocks

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def state(self) -> dict:
        """The /kvguard/state JSON (docs/architecture.md), without server-only fields."""
        with self._lock:
            cfg = self.config
            return {
                "model": cfg.model.name, "backend": getattr(self.runner, "backend", "custom"),
                "max_model_len": cfg.max_model_len, "block_size": cfg.cache.block_size,
                "num_total_blocks": self.num_total_blocks, "num_free_blocks": self.num_free_blocks,
                "max_num_seqs": cfg.scheduler.max_num_seqs,
                "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
                "num_preemptions": self.scheduler.num_preemptions, "step_count": self._step_count,
                **self._prefix_cache_state(),
                "now_s": self._clock(),
                "running": [self._seq_state(s) for s in self.scheduler.running],
                "waiting": [self._seq_state(s, waiting=True) for s in self.scheduler.waiting],
                # vars(), not asdict(): no deep copies of plain numbers, on the engine thread
                "iterations": [dict(vars(r)) for r in self._iterations],
                "timing_model": getattr(self.runner, "timing_model", None),
                "time_scale": getattr(self.runner, "time_scale", 1.0),
            }

    def _prefix_cache_state(self) -> dict:
        pool = self.block_manager.pool
        return {"enable_prefix_caching": self.config.cache.enable_prefix_caching,
                "num_cached_blocks": pool.num_cached_blocks,
                "num_evictable_blocks": pool.num_evictable_blocks,
                "prefix_cache_queries": self.scheduler.num_prefix_query_tokens,
                "prefix_cache_hits": self.scheduler.num_prefix_hit_tokens,
                "block_hash": {"version": HASH_VERSION, "model": self.config.model.name},
                "kv_events_endpoint": self._kv_events_endpoint,
                "kv_events_replay_endpoint": self._kv_events_replay_endpoint}

    def _seq_state(self, seq: Sequence, waiting: bool = False) -> dict:
        to_prefill = seq.num_uncomputed_tokens - (1 if seq.num_output_tokens else 0)
        if waiting and not seq.num_computed_tokens:
            # what it will prefill once scheduled: its cached prefix is found then, not prefilled
            # (a lookup that changes nothing; an eviction meanwhile can still shorten the hit)
            bm = self.block_manager
            hits = bm.find_cached_blocks(seq.block_hashes, (seq.num_tokens - 1) // bm.block_size)
            to_prefill -= len(hits) * bm.block_size
        return {"request_id": seq.request_id, "num_prompt_tokens": seq.num_prompt_tokens,
                "num_output_tokens": seq.num_output_tokens, "max_tokens": seq.params.max_tokens,
                "num_context_tokens": seq.num_tokens, "num_prefill_tokens_remaining": to_prefill,
                "num_blocks": len(self.block_manager.block_table(seq.request_id)),
                "num_cached_tokens": seq.num_cached_tokens,
                "priority": seq.priority}

    def sequence_status(self, request_id: str) -> SequenceStatus | None:
        """WAITING or RUNNING while the engine holds the request, else None."""
        with self._lock:
            seq = self.scheduler.get(request_id)
            return None if seq is None else seq.status


def _default_kv_budget_bytes(config: EngineConfig, runner: Runner | None) -> int:
    """1 GiB, or on CUDA (torch runner) 90 % of free GPU memory less the weights."""
    if runner is not None or not config.resolved_device().startswith("cuda"):
        return 1 << 30
    import torch

    free_bytes, _ = torch.cuda.mem_get_info(torch.device(config.resolved_device()))
    return max(int(0.9 * free_bytes) - config.weight_bytes, 1 << 20)


def _load_smollm2(preset: ModelConfig) -> tuple[ModelConfig, dict]:
    try:
        from engine.gguf_loader import load_smollm2
    except ImportError as exc:
        raise ValueError(f"smollm2-135m needs engine.gguf_loader: {exc}") from exc
    fields, state_dict = load_smollm2()
    known = {f.name for f in dataclasses.fields(ModelConfig)} - {"name", "weights"}
    model = dataclasses.replace(preset, **{k: v for k, v in fields.items() if k in known})
    return model, state_dict


def _load_smollm2_tokenizer() -> Any:
    """The SmolLM2 tokenizer, or None where its module or file is missing."""
    try:
        from engine.tokenizer import load_smollm2_tokenizer

        return load_smollm2_tokenizer()
    except (ImportError, FileNotFoundError):
        return None
