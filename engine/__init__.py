"""The LLM inference engine: paged KV cache, continuous batching, prefix caching, priorities.

Knows tokens, not speech. Offline use: :class:`LLM`; online use: :class:`AsyncEngine`.
"""

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.engine_builder import build_engine
from engine.engine_core import EngineCore, RequestError
from engine.llm import LLM
from engine.loaded_model import LoadedModel
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling import SamplingError, SamplingParams

__all__ = [
    "LLM", "AsyncEngine", "EngineCore", "build_engine", "LoadedModel", "EngineConfig", "ModelConfig", "SamplingParams",
    "RequestOutput", "CompletionOutput", "ConfigError", "RequestError", "SamplingError", "EngineDeadError",
]
