"""The speculative engine: propose -> verify -> accept -> commit/rollback, for ragged batches."""

from .core import Engine, EngineConfig
from ..models.prefill import PromptCache
from .request import GenerationParams, Request, RequestStats

__all__ = ["Engine", "EngineConfig", "PromptCache", "GenerationParams", "Request", "RequestStats"]
