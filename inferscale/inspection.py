"""The inspecting half of :class:`~inferscale.memory.Memory`: what the store holds and what chats
used. Its calls read only; the page at ``/ui`` (:mod:`inferscale.server.ui`) and Jupyter's
rich display (:mod:`inferscale.display`) are built on them."""

from __future__ import annotations

from typing import Sequence

import inferscale.arguments as args
from inferscale.checks import check_id, check_int

from inferscale.components import Components
from inferscale.config import MemoryConfig
from inferscale.kv.inventory import kv_entries
from inferscale.store.records import Scope
from inferscale.store.turns import Turn
from inferscale.types import MemoryNotFoundError

#: the largest context window (turns) a report is read at, as MemoryConfig.context_window allows
MAX_CONTEXT_WINDOW = 100_000


class Inspection:
    """What :class:`~inferscale.memory.Memory` shows of itself (not used on its own)."""

    components: Components
    config: MemoryConfig

    def scopes(self) -> list[dict]:
        """Every scope that holds memories, oldest first: ``[{"user_id" / "agent_id" /
        "run_id" (those set), "memories" (count), "created_at" (its first write),
        "updated_at" (its last write)}]``, from the history log (one query)."""
        self._check_open()
        return [{**Scope.from_key(key).as_dict(), "memories": n, "created_at": first, "updated_at": last}
                for key, n, first, last in self.components.history_log.scopes()]

    def kv_entries(self, memory_ids: Sequence[str] | None = None, *, user_id: str | None = None,
                   agent_id: str | None = None, run_id: str | None = None,
                   context_window: int | None = None) -> dict[str, list[dict]]:
        """Where each memory's KV is and how it was made (:func:`inferscale.kv.inventory.kv_entries`):
        per memory id, its entries (``key``, ``made``: encoded at w or captured, ``in_use``,
        ``tiers``, ``storage`` dtype, ``bytes``, ``tokens``, ``last_use``), the one a request
        at ``context_window`` (default ``config.context_window``) would inject first.

        Args:
            memory_ids: memories of the scope (default: all of them).

        Raises:
            inferscale.types.MemoryNotFoundError: an id the scope does not hold.
            ValueError / TypeError: a bad id or context window.
        """
        scope = self._scope(user_id, agent_id, run_id)
        w = self.config.context_window if context_window is None else check_int(
            "context_window", context_window, 0, maximum=MAX_CONTEXT_WINDOW)
        facts = self.components.facts
        if memory_ids is None:
            records = facts.list(scope, None)
        else:
            if isinstance(memory_ids, (str, bytes)) or not isinstance(memory_ids, Sequence):
                raise TypeError(f"memory_ids must be a list of memory ids, got {type(memory_ids).__name__}")
            ids = [check_id("memory_id", i) for i in memory_ids]
            held = {r.id: r for r in facts.list(scope, None)}  # one read of the scope, not one per id
            missing = [i for i in ids if i not in held]
            if missing:
                facts.get(scope, missing[0])  # raises MemoryNotFoundError naming it
            records = [held[i] for i in ids]
        return kv_entries(self.components.kv, scope.key, records, w)

    def kv_report(self, *, user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None,
                  limit: int = 1000) -> tuple[list[dict], dict[str, list[dict]], int]:
        """The scope's first ``limit`` memories (oldest first, Mem0's items), their KV entries at
        the configured w (:meth:`kv_entries`), and how many memories the scope holds: the page
        at ``/ui`` lists them.

        Raises:
            TypeError / ValueError: ``limit`` is not an int of at least 1.
        """
        scope = self._scope(user_id, agent_id, run_id)
        check_int("limit", limit, 1)
        records = self.components.facts.list(scope, None)
        shown = records[:limit]
        kv = kv_entries(self.components.kv, scope.key, shown, self.config.context_window)
        return [r.to_item() for r in shown], kv, len(records)

    def chats(self, *, user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None,
              limit: int = 50) -> list[dict]:
        """The scope's newest chat reports (chats ``inferscale serve`` answered with memory),
        newest first: ``{"id", "created_at", "query", "mode", "memories" ([{"id", "memory",
        "score", "as" ("kv" or "text"), "source"}] in rank order), "kv_tokens", "injected_tokens",
        "prompt_tokens", "prefilled_tokens", "completion_tokens", "ttft_s" (streamed chats;
        seconds), "latency_s", "retrieval_ms", "stream", "replica", "status"}`` (see
        :mod:`inferscale.store.chat_log`).

        Raises:
            TypeError / ValueError: ``limit`` is not an int in 1..1000.
        """
        scope = self._scope(user_id, agent_id, run_id)
        check_int("limit", limit, 1, maximum=1000)
        return self.components.chats.recent(scope.key, limit)

    def _repr_html_(self) -> str:
        """Jupyter's rich display: scopes and the KV pool (:func:`inferscale.display.memory_html`)."""
        from inferscale.display import memory_html

        pool = self.components.pool
        budgets = {"device": pool.device_budget_bytes, "host": pool.host_budget_bytes,
                   "disk": pool.disk_budget_bytes}
        return memory_html(self.scopes(), self.kv_stats(), budgets, self.config.data_dir)

    def history(self, memory_id: str, *, user_id: str | None = None, agent_id: str | None = None,
                run_id: str | None = None) -> list[dict]:
        """The ADD / UPDATE / DELETE events of a memory of the scope, oldest first.

        Raises:
            inferscale.types.MemoryNotFoundError: the scope never held this memory.
        """
        scope = self._scope(user_id, agent_id, run_id)
        check_id("memory_id", memory_id)
        events = self.components.history_log.events(scope.key, memory_id)
        if not events:
            raise MemoryNotFoundError(f"memory {memory_id!r} not found for {scope.as_dict()}")
        return [e.to_dict() for e in events]

    def owner_of(self, memory_id: str) -> dict[str, str]:
        """The scope of a memory from its id alone (``{"user_id": "alice"}``), for APIs that
        address memories by id (Mem0's Platform API); memory ids are uuid4s, unique across
        scopes. A deleted memory keeps its owner (its history is still the scope's).

        Raises:
            inferscale.types.MemoryNotFoundError: no scope ever held this memory.
        """
        self._check_open()
        check_id("memory_id", memory_id)
        key = self.components.history_log.owner(memory_id)
        if key is None:
            raise MemoryNotFoundError(f"memory {memory_id!r} not found")
        return Scope.from_key(key).as_dict()

    def count(self, *, user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None) -> int:
        """How many memories the scope holds."""
        return self.components.facts.count(self._scope(user_id, agent_id, run_id))

    def get_turns(self, *, user_id: str | None = None, agent_id: str | None = None,
                  run_id: str | None = None) -> list[Turn]:
        """Every turn of the scope's conversation log, oldest first."""
        return self.components.turns.scope_turns(self._scope(user_id, agent_id, run_id).key)

    def count_turns(self, *, user_id: str | None = None, agent_id: str | None = None,
                    run_id: str | None = None) -> int:
        """How many turns the scope's conversation log holds."""
        return self.components.turns.count(self._scope(user_id, agent_id, run_id).key)

    def find_texts(self, texts: Sequence[str], *, user_id: str | None = None, agent_id: str | None = None,
                   run_id: str | None = None) -> dict[str, str]:
        """Map each of ``texts`` that the scope already stores (exact text) to its memory id.

        Raises:
            TypeError / ValueError: ``texts`` is not a list of non-empty strings.
        """
        scope = self._scope(user_id, agent_id, run_id)
        return self.components.facts.find_texts(scope, args.check_texts(texts))
