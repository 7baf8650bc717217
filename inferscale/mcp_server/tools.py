"""The MCP tools over one memory, with Mem0's names: ``add``, ``search``, ``get_all``,
``update``, ``delete`` and ``answer`` (one implementation for stdio and streamable HTTP).

Each tool is an async method of :class:`MemoryTools`; the memory's sync calls run on a worker
thread (``anyio.to_thread``), so a write waiting for its lock never blocks the event loop.
A bad argument comes back as an MCP tool error (``isError: true``) whose text names the cause
and the fix: the memory's ``ValueError`` / ``TypeError`` / ``MemoryNotFoundError`` /
``UnknownScopeError``, a limit out of range, a dependency that does not answer
(:mod:`inferscale.runtime.outages`: "vLLM's server is not answering ..."). Anything else is a
bug: the SDK logs its traceback and the client gets ``Error executing tool <name>``.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import asdict
from typing import Annotated, Any, Iterator, Literal, Protocol

import anyio.to_thread
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field
from typing_extensions import TypedDict  # pydantic reads typing's TypedDict only from Python 3.12

from inferscale.checks import check_int
from inferscale.mcp_server.answers import Answers, LocalAnswers
from inferscale.runtime.outages import NAMES, OUTAGES, RETRY_AFTER_S
from inferscale.store.records import Scope
from inferscale.types import MemoryNotFoundError, UnknownScopeError, require_text

#: Most results one ``search`` or ``get_all`` returns (they go into a model's context).
MAX_LIMIT = 1000
#: Most memories one ``answer`` retrieves, and most tokens it writes.
MAX_K, MAX_ANSWER_TOKENS = 200, 4096
_SCOPE_HINT = 'give user_id (the user\'s id), agent_id or run_id, e.g. {"user_id": "alice"}'
_FIND_ID = "find its id with search or get_all (same user_id / agent_id / run_id)"


class Message(TypedDict):
    """One message of a conversation to remember."""

    role: Literal["user", "assistant", "system"]
    content: str


def _range(low: int, high: int) -> dict[str, int]:
    """A range shown in the input schema; the tool checks it (so the error is a sentence, not pydantic's)."""
    return {"minimum": low, "maximum": high}


UserId = Annotated[str | None, Field(description="Whose memory: the user's id. Give at least one of user_id, agent_id, "
                                                 "run_id; every call about one user must use the same ids.")]
AgentId = Annotated[str | None, Field(description="The agent's id, for an agent's own memory (or with user_id: what "
                                                  "this agent knows of this user).")]
RunId = Annotated[str | None, Field(description="The run's (session's) id, for the memory of one conversation only.")]
MemoryId = Annotated[str, Field(description="The memory's id, as add, search or get_all returned it.")]
Text = Annotated[str | None, Field(description="One fact or note to remember, in plain words (or give messages "
                                               "instead).")]
Messages = Annotated[list[Message] | None, Field(description="A conversation to remember, oldest first (or give text "
                                                             "instead).")]
Metadata = Annotated[dict[str, Any] | None, Field(description="JSON attached to every memory stored, to filter "
                                                              "searches by later.")]
Infer = Annotated[bool, Field(description="true: the served LLM extracts facts from the messages and merges them with "
                                          "the stored ones (slower); false: store each text as given.")]
Query = Annotated[str, Field(description="What to look for, in plain words.")]
SearchLimit = Annotated[int | None, Field(description=f"Most results, 1-{MAX_LIMIT} (default 10).",
                                          json_schema_extra=_range(1, MAX_LIMIT))]
TopK = Annotated[int | None, Field(description="Mem0's newer name for limit; give one of them.",
                                   json_schema_extra=_range(1, MAX_LIMIT))]
Filters = Annotated[dict[str, Any] | None, Field(description='Metadata filters, e.g. {"topic": "home"} or {"n": '
                                                             '{"$gte": 2}}, combined with {"AND": [...]} or {"OR": '
                                                             '[...]}.')]
ListLimit = Annotated[int, Field(description=f"Most memories, 1-{MAX_LIMIT} (default 100).",
                                 json_schema_extra=_range(1, MAX_LIMIT))]
NewText = Annotated[str, Field(description="The memory's new text (it replaces the old one).")]
Question = Annotated[str, Field(description="The question to answer from memory.")]
WaitForKV = Annotated[bool, Field(description="true: make the KV of retrieved memories that have none yet (added a "
                                              "moment ago) before answering, instead of reading them as text.")]
K = Annotated[int | None, Field(description=f"Memories to retrieve, 0-{MAX_K} (default: the server's top_k).",
                                json_schema_extra=_range(0, MAX_K))]
MaxTokens = Annotated[int | None, Field(description=f"Longest answer, 1-{MAX_ANSWER_TOKENS} tokens (default: the "
                                                    "server's default_max_tokens).",
                                        json_schema_extra=_range(1, MAX_ANSWER_TOKENS))]


class MemoryLike(Protocol):
    """What the tools call (:class:`inferscale.Memory`)."""

    config: Any

    def add(self, messages: Any, **kwargs: Any) -> dict: ...

    def search(self, query: str, **kwargs: Any) -> dict: ...

    def get_all(self, **kwargs: Any) -> dict: ...

    def update(self, memory_id: str, data: str, **kwargs: Any) -> dict: ...

    def delete(self, memory_id: str, **kwargs: Any) -> dict: ...


class MemoryTools:
    """The tools over one memory; :mod:`inferscale.mcp_server.app` registers the methods
    named in :data:`TOOLS` on the SDK's server.

    Args:
        memory: an open :class:`inferscale.Memory`.
        answers: how ``answer`` runs (default :class:`~inferscale.mcp_server.answers.LocalAnswers`,
            the memory's own engine).
    """

    def __init__(self, memory: MemoryLike, answers: Answers | None = None) -> None:
        self.memory = memory
        self.answers = answers or LocalAnswers(memory)

    async def _call(self, method, *args: Any, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)`` on a worker thread, its errors as tool errors."""
        with tool_errors():
            return await anyio.to_thread.run_sync(functools.partial(method, *args, **kwargs))

    async def add(self, text: Text = None, messages: Messages = None, user_id: UserId = None,
                  agent_id: AgentId = None, run_id: RunId = None, metadata: Metadata = None,
                  infer: Infer = False) -> dict[str, Any]:
        """Remember ``text`` or ``messages`` (:meth:`inferscale.Memory.add`).

        Returns:
            ``{"results": [{"id", "memory", "event"}]}``, ``event`` one of ADD, UPDATE, DELETE, NOOP.

        Raises:
            ToolError: neither or both of text and messages, no scope, empty text, bad metadata.
        """
        if (text is None) == (messages is None):
            raise ToolError("give the memory as text (a string) or as messages (a list of {role, content}), "
                            f"exactly one of them{'' if text is None else ', not both'}")
        return await self._call(self.memory.add, text if messages is None else [dict(m) for m in messages],
                                **_scope(user_id, agent_id, run_id).as_dict(), metadata=metadata, infer=infer)

    async def search(self, query: Query, user_id: UserId = None, agent_id: AgentId = None, run_id: RunId = None,
                     limit: SearchLimit = None, top_k: TopK = None, filters: Filters = None) -> dict[str, Any]:
        """The scope's memories best matching ``query`` (:meth:`inferscale.Memory.search`).

        Returns:
            ``{"results": [{"id", "memory", "score", "metadata", ...}]}``, best first.

        Raises:
            ToolError: no scope, empty query, limit out of range, malformed filters.
        """
        scope = _scope(user_id, agent_id, run_id)
        limit = _bounded("limit", limit, 1, MAX_LIMIT, "ask for fewer results")
        top_k = _bounded("top_k", top_k, 1, MAX_LIMIT, "ask for fewer results")
        if limit is None and top_k is None:
            limit = 10
        return await self._call(self.memory.search, query, **scope.as_dict(), limit=limit, top_k=top_k,
                                filters=filters)

    async def get_all(self, user_id: UserId = None, agent_id: AgentId = None, run_id: RunId = None,
                      limit: ListLimit = 100) -> dict[str, Any]:
        """Every memory of the scope, oldest first, at most ``limit`` (:meth:`inferscale.Memory.get_all`).

        Returns:
            ``{"results": [{"id", "memory", "metadata", "created_at", ...}]}``.

        Raises:
            ToolError: no scope, limit out of range.
        """
        scope = _scope(user_id, agent_id, run_id)
        limit = _bounded("limit", limit, 1, MAX_LIMIT, "ask for fewer memories, or use search")
        return await self._call(self.memory.get_all, **scope.as_dict(), limit=limit)

    async def update(self, memory_id: MemoryId, text: NewText, user_id: UserId = None, agent_id: AgentId = None,
                     run_id: RunId = None) -> dict[str, Any]:
        """Replace a memory's text (:meth:`inferscale.Memory.update`; its KV is invalidated).

        Returns:
            ``{"message", "id", "memory"}``.

        Raises:
            ToolError: no scope, empty text, no such memory in the scope.
        """
        scope = _scope(user_id, agent_id, run_id)
        return await self._call(self.memory.update, memory_id, text, **scope.as_dict())

    async def delete(self, memory_id: MemoryId, user_id: UserId = None, agent_id: AgentId = None,
                     run_id: RunId = None) -> dict[str, Any]:
        """Delete one memory of the scope (:meth:`inferscale.Memory.delete`).

        Returns:
            ``{"message": "Memory deleted successfully!"}``.

        Raises:
            ToolError: no scope, no such memory in the scope.
        """
        scope = _scope(user_id, agent_id, run_id)
        return await self._call(self.memory.delete, memory_id, **scope.as_dict())

    async def answer(self, question: Question, user_id: UserId = None, agent_id: AgentId = None,
                     run_id: RunId = None, k: K = None, max_tokens: MaxTokens = None,
                     wait_for_kv: WaitForKV = False) -> dict[str, Any]:
        """Answer ``question`` with the scope's memories injected as precomputed KV (``wait_for_kv``:
        those not encoded yet are encoded first, not read as text).

        Returns:
            ``{"text", "memories", "kv_memory_ids", "text_memory_ids", "kv_sources", "injected_tokens"}``
            (:class:`~inferscale.mcp_server.answers.Answer`).

        Raises:
            ToolError: no scope, an unknown scope, empty question, k or max_tokens out of range,
                vLLM not answering.
        """
        scope = _scope(user_id, agent_id, run_id)
        k = _bounded("k", k, 0, MAX_K, "retrieve fewer memories")
        max_tokens = _bounded("max_tokens", max_tokens, 1, MAX_ANSWER_TOKENS, "ask for a shorter answer")
        with tool_errors():
            require_text(question, "question")
            try:
                answer = await self.answers(question, scope, k, max_tokens or self.memory.config.default_max_tokens,
                                            wait_for_kv)
            except UnknownScopeError:
                raise ToolError(f"no memories for {scope.as_dict()}: add some with the add tool first, or check "
                                "user_id / agent_id / run_id") from None
        return asdict(answer)


#: The tools, in the order clients list them: (method name, description for the model, read-only,
#: destructive: it may change or remove what is stored; MCP's tool annotations).
TOOLS: tuple[tuple[str, str, bool, bool], ...] = (
    ("add", "Remember something about a user (or agent, or run): a fact or a conversation. Use it when the user "
            "tells you something worth keeping for later (preferences, facts about them, plans). Returns the "
            "stored memories with their ids.", False, False),
    ("search", "Find the stored memories of a user (or agent, or run) that best match a query, best first. Use it "
               "before answering anything that may depend on what you were told earlier.", True, False),
    ("get_all", "List every stored memory of a user (or agent, or run), oldest first. Use it to review or audit "
                "memory; to find something specific, use search.", True, False),
    ("update", "Replace the text of one stored memory (by its id from add, search or get_all), when a fact "
               "changed.", False, True),
    ("delete", "Delete one stored memory by its id (from add, search or get_all), when it is wrong or the user "
               "asks to forget it.", False, True),
    ("answer", "Answer a question with the user's memories, served by InferScale's own LLM with the memories "
               "injected as precomputed KV cache. Returns the answer's text and which memories it used (and which "
               "came as KV, which as text). Use search instead when you answer yourself.", True, False),
)


@contextlib.contextmanager
def tool_errors() -> Iterator[None]:
    """Raise the memory's expected errors as :class:`ToolError` (the client's ``isError: true``
    result), with a message naming the cause and the fix."""
    try:
        yield
    except ToolError:
        raise
    except MemoryNotFoundError as exc:
        raise ToolError(f"{exc}: {_FIND_ID}") from None
    except UnknownScopeError as exc:
        raise ToolError(f"{exc}: add memories for this scope first, or check user_id / agent_id / run_id") from None
    except Exception as exc:
        dependency = OUTAGES.dependency_of(exc)
        if dependency is not None:
            OUTAGES.failed(dependency, exc)
            raise ToolError(f"{NAMES[dependency]} is not answering ({type(exc).__name__}); retry in "
                            f"{RETRY_AFTER_S} s") from None
        if isinstance(exc, (ValueError, TypeError)):
            raise ToolError(str(exc)) from None
        raise


def _scope(user_id: str | None, agent_id: str | None, run_id: str | None) -> Scope:
    if not (user_id or agent_id or run_id):
        raise ToolError(f"say whose memory: {_SCOPE_HINT}")
    with tool_errors():
        return Scope.of(user_id, agent_id, run_id)


def _bounded(name: str, value: int | None, low: int, high: int, fix: str) -> int | None:
    try:
        return check_int(name, value, low, maximum=high, optional=True)
    except (TypeError, ValueError) as exc:
        too_many = isinstance(exc, ValueError) and value is not None and value > high
        raise ToolError(f"{exc}: give {name} from {low} to {high}" + (f" ({fix})" if too_many else "")) from None
