"""``AsyncMemory``: the same implementation as :class:`inferscale.Memory`, awaited.

Every method runs the synchronous one in a worker thread (``asyncio.to_thread``), so
there is one code path for both modes and the event loop is never blocked by embedding,
Chroma I/O, KV encoding or generation. The synchronous :class:`Memory` itself never
touches an event loop, so it works inside a running one too (Jupyter).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from inferscale.memory import Memory

_METHODS = (
    "add", "add_facts", "log_turns", "get", "get_all", "search", "update", "update_metadata", "delete",
    "batch_update", "batch_delete",
    "delete_all", "history", "reset", "inject", "prepare", "generate", "count", "close",
    "wait_for_kv", "pending_kv", "get_turns", "delete_turns", "find_texts", "count_turns", "owner_of", "scopes",
    "kv_entries", "chats",
)


class AsyncMemory:
    """Async facade over a :class:`Memory`.

    Args:
        config / memory / **overrides: either an existing ``memory=Memory(...)``, or the
            arguments :class:`Memory` takes.

    Raises:
        TypeError: ``memory`` is not a :class:`Memory`, or is given with other arguments;
            as :class:`Memory` otherwise.

    Example:
        >>> m = AsyncMemory(data_dir="./mem")
        >>> await m.add("I like green tea.", user_id="alice")
        >>> await m.search("drinks", user_id="alice")
    """

    def __init__(self, config=None, *, memory: Memory | None = None, **overrides: Any) -> None:
        if memory is not None and not isinstance(memory, Memory):
            raise TypeError(f"memory must be an inferscale.Memory, got {type(memory).__name__}")
        if memory is not None and (config is not None or overrides):
            raise TypeError("give either memory=Memory(...) or Memory's arguments, not both")
        self.sync = memory if memory is not None else Memory(config, **overrides)

    @classmethod
    def from_config(cls, config: dict) -> "AsyncMemory":
        return cls(memory=Memory.from_config(config))

    def __getattr__(self, name: str):
        if name not in _METHODS:
            raise AttributeError(f"AsyncMemory has no attribute {name!r}")
        method = getattr(self.sync, name)

        @functools.wraps(method)
        async def call(*args: Any, **kwargs: Any):
            return await asyncio.to_thread(method, *args, **kwargs)

        return call
