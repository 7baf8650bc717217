"""The fields every InferScale LangChain component shares: the memory and the scope."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from inferscale import Memory
from inferscale.integration import PlainErrors, ScopeFields


class MemoryScope(PlainErrors, ScopeFields):
    """An InferScale memory and whose memories to use (``user_id`` / ``agent_id`` / ``run_id``).

    Raises:
        TypeError / ValueError: (from the constructor) a field of the wrong type or value,
            as one line naming it.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    memory: Memory = Field(exclude=True)
