"""The fields every InferScale LangChain component shares: the memory and the scope."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from inferscale import Memory
from inferscale.options import PlainErrors


class MemoryScope(PlainErrors, BaseModel):
    """An InferScale memory and whose memories to use (``user_id`` / ``agent_id`` / ``run_id``).

    Raises:
        TypeError / ValueError: (from the constructor) a field of the wrong type or value,
            as one line naming it.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    memory: Memory = Field(exclude=True)
    user_id: str | None = None
    agent_id: str | None = None
    run_id: str | None = None

    @field_validator("user_id", "agent_id", "run_id")
    @classmethod
    def _not_blank(cls, value: str | None, info) -> str | None:
        if value is not None and not value.strip():
            raise ValueError(f"{info.field_name} must be a non-empty string, got {value!r}")
        return value
