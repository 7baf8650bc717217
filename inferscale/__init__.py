"""InferScale: memory for LLM agents, served to vLLM as precomputed KV cache."""

from inferscale.async_memory import AsyncMemory
from inferscale.config import MemoryConfig
from inferscale.memory import Memory
from inferscale.options import GenerationOptions
from inferscale.types import FactInput, Generation, GenerationChunk, Injection, MemoryNotFoundError, UnknownScopeError

__all__ = [
    "AsyncMemory", "FactInput", "Generation", "GenerationChunk", "GenerationOptions", "Injection", "Memory",
    "MemoryConfig", "MemoryNotFoundError", "UnknownScopeError",
]
__version__ = "0.1.0"
