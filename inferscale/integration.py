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
- :func:`machine`, :func:`write_outputs`: where a benchmark ran, and its JSON and page
  written as InferScale's own benchmarks write them (an adapter's benchmark).
"""

from __future__ import annotations

from inferscale.arguments import check_metadata
from inferscale.checks import check_int
from inferscale.generation.options import PlainErrors, ScopeFields, check_call_options
from inferscale.sessions import ChatSessions, SessionMessage
from inferscale.store.filters import compile_filter
from inferscale.store.records import Scope
from inferscale.types import require_text

def machine() -> dict:
    """Where a benchmark ran: CPU, cores, memory, GPU, versions, commit
    (:func:`inferscale.bench.common.machine`)."""
    from inferscale.bench.common import machine as _machine

    return _machine()


def write_outputs(out_dir, name: str, summary: dict, markdown: str) -> None:
    """Write ``<out_dir>/<name>.json`` (``summary`` and :func:`machine`) and ``<name>.md``
    (:func:`inferscale.bench.common.write_outputs`).

    Raises:
        OSError: the folder cannot be written.
    """
    from inferscale.bench.common import write_outputs as _write

    _write(out_dir, name, summary, markdown)


#: Incremented when a name here changes meaning; the adapters pin the 0.1 series.
INTEGRATION_API = 1

__all__ = ["INTEGRATION_API", "ChatSessions", "PlainErrors", "Scope", "ScopeFields", "SessionMessage",
           "check_call_options", "check_int", "check_metadata", "compile_filter", "machine", "require_text",
           "write_outputs"]
