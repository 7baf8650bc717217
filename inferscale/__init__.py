"""InferScale: memory for LLM agents, served to vLLM as precomputed KV cache.

The public names load on first use (PEP 562), so ``import inferscale.kv.injection``
needs only torch and transformers (the GPU microbenchmark relies on that).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncMemory": "inferscale.async_memory",
    "FactInput": "inferscale.types",
    "Generation": "inferscale.types",
    "GenerationChunk": "inferscale.types",
    "GenerationOptions": "inferscale.generation.options",
    "Injection": "inferscale.types",
    "Memory": "inferscale.memory",
    "MemoryConfig": "inferscale.config",
    "MemoryNotFoundError": "inferscale.types",
    "UnknownScopeError": "inferscale.types",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"

if TYPE_CHECKING:
    from inferscale.async_memory import AsyncMemory
    from inferscale.config import MemoryConfig
    from inferscale.memory import Memory
    from inferscale.generation.options import GenerationOptions
    from inferscale.types import (
        FactInput,
        Generation,
        GenerationChunk,
        Injection,
        MemoryNotFoundError,
        UnknownScopeError,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'inferscale' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
