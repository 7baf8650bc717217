"""LangChain's standard unit tests for ``ChatInferScale`` (``langchain-tests``): construction,
``bind_tools``, ``with_structured_output`` and LangSmith parameters, without generating."""

from __future__ import annotations

import pytest
from langchain_inferscale import ChatInferScale
from langchain_tests.unit_tests import ChatModelUnitTests


class TestChatInferScaleUnit(ChatModelUnitTests):
    @pytest.fixture(autouse=True)
    def _memory(self, unit_memory, suite_user):
        type(self).memory, type(self).user = unit_memory, suite_user

    @property
    def chat_model_class(self) -> type[ChatInferScale]:
        return ChatInferScale

    @property
    def standard_chat_model_params(self) -> dict:
        # an in-process engine: no HTTP timeout, retries or API key to set
        return {"temperature": 0, "max_tokens": 100, "stop": []}

    @property
    def chat_model_params(self) -> dict:
        return {"memory": self.memory, "user_id": self.user}

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True
