"""LangChain integration for InferScale.

- :class:`InferScaleChatMessageHistory`: a session's messages, each written to the
  user's memory (turn log, memories, KV precompute).
- :class:`ChatInferScale`: a chat model served by vLLM with the user's memories
  injected as precomputed KV.
- :class:`InferScaleRetriever`: the user's memories as scored ``Document`` s.
- :class:`InferScaleStore`: a LangGraph ``BaseStore`` whose items are memories (in-process
  or over ``inferscale serve``).
"""

from langchain_inferscale.chat_message_histories import InferScaleChatMessageHistory
from langchain_inferscale.chat_models import ChatInferScale
from langchain_inferscale.retrievers import InferScaleRetriever
from langchain_inferscale.store import InferScaleStore

__all__ = ["ChatInferScale", "InferScaleChatMessageHistory", "InferScaleRetriever", "InferScaleStore"]
__version__ = "0.1.0"
