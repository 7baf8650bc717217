"""LangChain's standard integration tests (``langchain-tests``) for ``ChatInferScale`` and
``InferScaleRetriever`` on the real engine and SmolLM2-135M, with tool calling and
structured output on.

Every test that does not pass is marked here with its reason, and listed in
docs/adapters.md.
"""

from __future__ import annotations

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_inferscale import InferScaleRetriever
from langchain_tests.integration_tests import ChatModelIntegrationTests, RetrieversIntegrationTests
from suite_config import ChatInferScaleSuite

# Answer quality of the 135M default model, not missing plumbing: the call is made, well
# formed and valid for the tool's schema, but the model writes another argument. Not
# strict: a different CPU's numerics may flip a greedy choice.
WRONG_ARGUMENT = pytest.mark.xfail(reason="SmolLM2-135M calls magic_function with input=100 for "
                                          "'magic_function(3)' (the forced call is well formed)", strict=False)


class TestChatInferScaleIntegration(ChatInferScaleSuite, ChatModelIntegrationTests):
    @pytest.fixture(autouse=True)
    def _memory(self, suite_memory, suite_user):
        type(self).memory, type(self).user = suite_memory, suite_user

    @WRONG_ARGUMENT
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_tool_calling(self, model: BaseChatModel) -> None:
        super().test_tool_calling(model)

    @WRONG_ARGUMENT
    async def test_tool_calling_async(self, model: BaseChatModel) -> None:
        await super().test_tool_calling_async(model)

    @pytest.mark.xfail(reason="json_mode constrains the answer to some JSON object only; SmolLM2-135M nests "
                              "'setup' objects instead of writing the keys the prompt asks for (the json_schema "
                              "method, which constrains the keys, passes)", strict=False)
    def test_json_mode(self, model: BaseChatModel) -> None:
        super().test_json_mode(model)

    @pytest.mark.xfail(reason="tool_choice='auto': SmolLM2-135M answers in text instead of calling get_weather "
                              "(a forced tool_choice works, see test_tool_choice and the agent examples)", strict=False)
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model: BaseChatModel) -> None:
        super().test_agent_loop(model)


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
