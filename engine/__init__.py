"""kvguard's paged-KV, continuous-batching decode engine (torch; CPU, CUDA or simulated GPU)."""

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import IterationRecord, RequestOutput, StepResult
from engine.sampling_params import SamplingParams

__all__ = ["EngineConfig", "IterationRecord", "LLMEngine", "RequestOutput", "SamplingParams",
           "StepResult"]
