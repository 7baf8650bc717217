"""What LangChain's standard suites need to build ``ChatInferScale`` (shared by the unit and
integration subclasses; ``pythonpath`` in pyproject.toml makes it importable)."""

from __future__ import annotations

from langchain_inferscale import ChatInferScale


class ChatInferScaleSuite:
    """Mixin: the model class, its parameters and the features turned on; ``memory`` and
    ``user`` are set by each subclass's autouse fixture."""

    memory = None
    user = None

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

    @property
    def supports_json_mode(self) -> bool:
        return True

