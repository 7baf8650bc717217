"""LlamaIndex LLM served by InferScale's vLLM engine with memories injected as KV."""

from llama_index.llms.inferscale.base import InferScaleLLM

__all__ = ["InferScaleLLM"]
