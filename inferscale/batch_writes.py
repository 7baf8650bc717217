"""Writes of many memories in one call: ``add_facts`` (facts with provenance), and Mem0's platform
``batch_update`` and ``batch_delete``: the part of :class:`inferscale.Memory` that checks a
batch's entries, each named by its index, and hands them to
:class:`inferscale.facts.writes.FactService` as one write. A mixin: it uses the facade's
``_scope`` and ``components``."""

from __future__ import annotations

from typing import Sequence

import inferscale.arguments as args
from inferscale.checks import check_bool, check_id
from inferscale.types import FactInput, require_text, write_results


class BatchWrites:
    """``add_facts``, ``batch_update`` and ``batch_delete`` of :class:`inferscale.Memory`."""

    def add_facts(self, facts: Sequence[FactInput | str], *, user_id: str | None = None, agent_id: str | None = None,
                  run_id: str | None = None, encode_kv: bool = True, context_window: int | None = None,
                  dedupe: bool = True) -> dict:
        """Store facts with provenance (LoCoMo observations, extracted facts).

        Args:
            facts: :class:`FactInput` s (or plain strings, without provenance).
            encode_kv: encode each fact's KV now (else on first use).
            context_window: w to encode it at (default ``config.context_window``).
            dedupe: ``True`` (default): a text the scope already holds is a ``NOOP``;
                ``False``: every fact is a new memory (as :meth:`add`).

        Returns:
            ``{"results": [{"id", "memory", "event"}]}`` as :meth:`add`.

        Raises:
            ValueError / TypeError: empty text, a source turn id not in the scope's log,
                ``encode_kv`` or ``dedupe`` not a bool.
        """
        scope = self._scope(user_id, agent_id, run_id)
        check_bool("encode_kv", encode_kv)
        check_bool("dedupe", dedupe)
        args.check_context_window(context_window)
        inputs = args.fact_inputs(facts)
        wanted = sorted({t for f in inputs for t in f.source_turn_ids})
        known = self.components.turns.get(scope.key, wanted)
        if len(known) != len(wanted):
            missing = [t for t in wanted if t not in known]
            raise ValueError(f"source turn ids {missing[:5]} are not in this scope's log: log them with log_turns first")
        return write_results(self.components.facts.add(scope, inputs, encode_kv=encode_kv,
                                                       context_window=context_window, dedupe=dedupe))

    def batch_update(self, memories: Sequence[dict], *, user_id: str | None = None, agent_id: str | None = None,
                     run_id: str | None = None, dedupe: bool = True) -> dict:
        """Replace the texts (and metadata, where given) of several memories of the scope in one
        write (Mem0's platform ``batch_update``): embedded in one call, written to Chroma in one
        update, recorded in the history in one transaction; their KV is invalidated and queued
        at once. All or nothing: everything is checked before anything is written.

        Args:
            memories: ``[{"memory_id": id, "text": new text, "metadata": dict (optional)}]``;
                an entry without ``text`` sets only its ``metadata`` fields (``None`` removes
                one), keeping the text, embedding, KV and ``updated_at``, as
                :meth:`update_metadata` does (those entries are one more write: one Chroma
                update and one history transaction for all of them).
            dedupe: as :meth:`update`.

        Returns:
            ``{"message": "N memories updated successfully!", "results": [{"id", "memory"}]}``,
            in the order given.

        Raises:
            inferscale.types.MemoryNotFoundError: an id is not a memory of this scope.
            TypeError / ValueError: ``memories`` is not a list of such dicts (an unknown key, a
                missing ``memory_id`` or ``text``), an empty or too long text, a memory given
                twice, or (``dedupe=True``) a text another memory holds.

        Example:
            >>> memory.batch_update([{"memory_id": a, "text": "I live in Lyon."},
            ...                      {"memory_id": b, "text": "I drink green tea.", "metadata": {"topic": "food"}}],
            ...                     user_id="alice")
        """
        scope = self._scope(user_id, agent_id, run_id)
        check_bool("dedupe", dedupe)
        items = args.batch_items("batch_update", memories, ("memory_id",), ("text", "metadata"))
        facts = self.components.facts
        changes, patches = [], []
        for i, item in enumerate(items):  # every entry checked, and named when refused, before anything is written
            what = f"batch_update entry {i}"
            try:
                check_id("memory_id", item["memory_id"])
                if "text" not in item and not isinstance(item.get("metadata"), dict):
                    raise ValueError("it has neither 'text' nor 'metadata': give the new text, or the metadata "
                                     "fields to set")
                if "text" in item:
                    require_text(item["text"], "its text")
                    facts.check_length(item["text"], "its text")
                    metadata = None if item.get("metadata") is None else args.check_metadata(item["metadata"])
                    scope.check_metadata(metadata)
                    changes.append((item["memory_id"], item["text"], metadata))
                else:
                    fields = args.check_metadata_patch(item["metadata"])
                    scope.check_metadata(fields)
                    patches.append((item["memory_id"], fields))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{what}: {exc}") from None
        records = {r.id: r for r in facts.update_many(scope, changes, patches, dedupe=dedupe)}
        ids = [c["memory_id"] for c in items]
        return {"message": f"{len(items)} memories updated successfully!",
                "results": [{"id": i, "memory": records[i].text} for i in ids]}

    def batch_delete(self, memories: Sequence[dict], *, user_id: str | None = None, agent_id: str | None = None,
                     run_id: str | None = None) -> dict:
        """Delete several memories of the scope (and their KV) in one write (Mem0's platform
        ``batch_delete``): one Chroma delete, one history transaction. All or nothing.

        Args:
            memories: ``[{"memory_id": id}]``.

        Returns:
            ``{"message": "N memories deleted successfully!"}``.

        Raises:
            inferscale.types.MemoryNotFoundError: an id is not a memory of this scope (nothing
                is deleted).
            TypeError / ValueError: ``memories`` is not a list of ``{"memory_id": id}`` dicts.
        """
        scope = self._scope(user_id, agent_id, run_id)
        items = args.batch_items("batch_delete", memories, ("memory_id",), ())
        for item in items:
            check_id("memory_id", item["memory_id"])
        deleted = self.components.facts.delete(scope, [i["memory_id"] for i in items])
        return {"message": f"{len(deleted)} memories deleted successfully!"}
