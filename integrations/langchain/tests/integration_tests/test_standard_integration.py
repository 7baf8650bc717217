"""LangChain's standard integration tests (``langchain-tests``) for ``ChatInferScale`` and
``InferScaleRetriever`` on the real engine and SmolLM2-135M, with tool calling and
structured output on.

Every test that does not pass is marked here with its reason, and listed in
docs/adapters.md.
"""

from __future__ import annotations

import pytest
from langchain_inferscale import ChatInferScale, InferScaleRetriever
from langchain_tests.integration_tests import ChatModelIntegrationTests, RetrieversIntegrationTests


class TestChatInferScaleIntegration(ChatModelIntegrationTests):
    @pytest.fixture(autouse=True)
    def _memory(self, suite_memory, suite_user):
        type(self).memory, type(self).user = suite_memory, suite_user

    @property
    def chat_model_class(self) -> type[ChatInferScale]:
        return ChatInferScale

    @property
    def standard_chat_model_params(self) -> dict:
        # an in-process engine: no HTTP timeout or retries to set
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

    @property
    def supports_json_mode(self) -> bool:
        return True


class TestInferScaleRetrieverIntegration(RetrieversIntegrationTests):
    @pytest.fixture(autouse=True)
    def _memory(self, suite_memory):
        type(self).memory = suite_memory
        if len(suite_memory.get_all(user_id="retriever-suite")["results"]) < 5:
            suite_memory.add_facts([f"Fact number {i} about the retriever suite." for i in range(5)],
                                   user_id="retriever-suite")

    @property
    def retriever_constructor(self) -> type[InferScaleRetriever]:
        return InferScaleRetriever

    @property
    def retriever_constructor_params(self) -> dict:
        return {"memory": self.memory, "user_id": "retriever-suite"}

    @property
    def retriever_query_example(self) -> str:
        return "retriever suite"
