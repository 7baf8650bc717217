"""What the framework adapters build on, beside the public names of :mod:`inferscale`.

``langchain-inferscale`` and ``llama-index-inferscale`` (``integrations/``) import only
``inferscale`` and this module, and depend on ``inferscale>=0.1,<0.2``: these names keep
their meaning within 0.1.x (:data:`INTEGRATION_API` counts breaking changes).

- :class:`ChatSessions`, :class:`SessionMessage`: chat sessions as tagged turns of a scope.
- :class:`ScopeFields`, :class:`PlainErrors`, :func:`check_call_options`: the adapters'
  pydantic fields (``user_id`` / ``agent_id`` / ``run_id``, generation knobs) with
  InferScale's one-line errors.
- :func:`check_int`: the integer check every entry point uses (``TypeError`` /
  ``ValueError``, one line).
- :func:`compile_filter`: Mem0-style metadata filters as a predicate over a memory's metadata.
- :class:`Scope`: whose memories (``Scope.of`` validates the ids, as every entry point does).
- :func:`check_metadata`, :func:`require_text`: what ``add`` refuses in a memory's metadata
  and text, for an adapter to check a batch before it writes any of it.
"""

from __future__ import annotations

from inferscale.arguments import check_metadata
from inferscale.checks import check_int
from inferscale.generation.options import PlainErrors, ScopeFields, check_call_options
from inferscale.sessions import ChatSessions, SessionMessage
from inferscale.store.filters import compile_filter
from inferscale.store.records import Scope
from inferscale.types import require_text

#: Incremented when a name here changes meaning; the adapters pin the 0.1 series.
INTEGRATION_API = 1

__all__ = ["INTEGRATION_API", "ChatSessions", "PlainErrors", "Scope", "ScopeFields", "SessionMessage",
           "check_call_options", "check_int", "check_metadata", "compile_filter", "require_text"]
