"""LlamaIndex memory block over InferScale memory."""

from llama_index.memory.inferscale.base import InferScaleMemoryBlock

__all__ = ["InferScaleMemoryBlock"]
