"""LangChain's standard unit tests for ``ChatInferScale`` (``langchain-tests``): construction,
``bind_tools``, ``with_structured_output`` and LangSmith parameters, without generating."""

from __future__ import annotations

import pytest
from langchain_tests.unit_tests import ChatModelUnitTests
from suite_config import ChatInferScaleSuite


class TestChatInferScaleUnit(ChatInferScaleSuite, ChatModelUnitTests):
    @pytest.fixture(autouse=True)
    def _memory(self, unit_memory, suite_user):
        type(self).memory, type(self).user = unit_memory, suite_user
