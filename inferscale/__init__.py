"""InferScale: memory for LLM agents, served to vLLM as precomputed KV cache."""

from inferscale.config import MemoryConfig
from inferscale.memory import FactInput, Generation, Injection, Memory, UnknownScopeError

__all__ = ["FactInput", "Generation", "Injection", "Memory", "MemoryConfig", "UnknownScopeError"]
__version__ = "0.1.0"
