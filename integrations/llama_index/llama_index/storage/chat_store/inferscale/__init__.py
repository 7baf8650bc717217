"""LlamaIndex chat store over InferScale memory."""

from llama_index.storage.chat_store.inferscale.base import InferScaleChatStore

__all__ = ["InferScaleChatStore"]
