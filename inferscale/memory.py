"""``Memory``: the Mem0-style facade, translating Mem0's calls onto the components.

The data dir's components are opened and wired by :func:`inferscale.components.open_components`;
arguments are checked by :mod:`inferscale.arguments` before anything is written. Writes go
through :class:`~inferscale.facts.writes.FactService` (Chroma, then the index, the history and the
KV queue); requests are built by :class:`~inferscale.generation.request.RequestBuilder` and run on the
vLLM engine with InferScale's connector (:mod:`inferscale.serving.engine`).

Every call is scoped by ``user_id`` / ``agent_id`` / ``run_id`` (at least one), by-id
calls included: another scope's memory id is "not found".
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any, Sequence

import inferscale.arguments as args
from inferscale.checks import check_bool, check_id, result_limit
from inferscale.answering import Answering
from inferscale.batch_writes import BatchWrites
from inferscale.inspection import Inspection
from inferscale.components import Components, open_components, resolve_models
from inferscale.config import MemoryConfig
from inferscale.facts.extraction import (FactExtractor, LLMFactExtractor, Reconciler, SimilarityReconciler,
                                         extract_and_reconcile)
from inferscale.runtime.lifecycle import close_at_exit
from inferscale.runtime.progress import when_slow
from inferscale.reopening import Reopenable
from inferscale.store.records import Scope
from inferscale.store.turns import Turn
from inferscale.types import FactInput, SearchResults, write_results


class Memory(Answering, BatchWrites, Inspection, Reopenable):
    """Persistent per-user memory served to vLLM as precomputed KV.

    Args:
        config: a :class:`~inferscale.config.MemoryConfig` or a dict of its fields
            (default: defaults plus ``INFERSCALE_*`` environment variables).
        engine: an existing :class:`~inferscale.serving.engine.Engine` whose connector reads
            this data dir's KV pool (default: one is started on first use).
        extractor: fact extraction for ``add(infer=True)`` (default :class:`LLMFactExtractor`).
        reconciler: ADD/UPDATE/DELETE/NOOP decisions (default :class:`SimilarityReconciler`).
        **overrides: fields of the config, e.g. ``Memory(data_dir="./mem", dtype="float32")``.

    Attributes:
        config: the settings. components: the opened store (:class:`~inferscale.components.Components`).
        model_path: the served LLM's folder. tokenizer: its tokenizer.
        kv_dir: the KV pool's folder (give it to your own vLLM's connector). device: torch's.

    Raises:
        inferscale.models.resolve.ModelNotFoundError: the LLM or embedder cannot be found.
        inferscale.store.records.StoreError: the data dir cannot be used (unwritable, written by a
            newer version or with another embedder; memories a ``chroma_url`` would hide).
        TypeError / ValueError: an unknown or invalid setting or argument.

    Example:
        >>> m = Memory(data_dir="./mem")
        >>> m.add("I am allergic to peanuts.", user_id="alice")
        >>> m.generate("What am I allergic to?", user_id="alice").text
    """

    def __init__(self, config: MemoryConfig | dict | None = None, *, engine=None,
                 extractor: FactExtractor | None = None, reconciler: Reconciler | None = None,
                 **overrides: Any) -> None:
        if isinstance(config, dict):  # Mem0's Memory.from_config(dict) style
            config = MemoryConfig(**config)
        if config is not None and not isinstance(config, MemoryConfig):
            raise TypeError(f"config must be a MemoryConfig or a dict of its fields, got {type(config).__name__}: "
                            "pass settings as keywords, e.g. Memory(data_dir='./mem')")
        if config is None:  # keywords win over INFERSCALE_* variables, which fill in the rest
            self.config = MemoryConfig(**overrides)
        else:
            self.config = MemoryConfig(**{**config.model_dump(exclude_unset=True), **overrides}) if overrides else config
        models = resolve_models(self.config)  # everything that can fail without touching the data dir comes first
        self.kv_dir = self.config.data_dir / "kv"
        if engine is not None and not hasattr(engine, "kv_dir"):
            raise TypeError(f"engine must be an inferscale.serving.engine.Engine, got {type(engine).__name__}")
        if extractor is not None and not callable(extractor):
            raise TypeError("extractor must be callable as extractor(turns, chat) "
                            "(inferscale.facts.extraction.FactExtractor), "
                            f"got {type(extractor).__name__}")
        if reconciler is not None and not callable(getattr(reconciler, "decide", None)):
            raise TypeError(f"reconciler must have a decide() method (inferscale.facts.extraction.Reconciler), "
                            f"got {type(reconciler).__name__}")
        if engine is not None and Path(engine.kv_dir).resolve() != self.kv_dir.resolve():
            raise ValueError(f"the given engine serves KV from {engine.kv_dir}, not this memory's {self.kv_dir}")
        self.components: Components = open_components(self.config, models)
        c = self.components
        try:
            self.model_path, self.tokenizer, self.device = c.model_path, c.tokenizer, c.device
            self.extractor = extractor or LLMFactExtractor()
            self.reconciler = reconciler or SimilarityReconciler()
            self._closed, self._pid = False, os.getpid()
            self._attach_engine(engine)
            close_at_exit(self, first=True)  # a script that never calls close() still exits cleanly
            # a memory collected without close() lets go of the folder's pool too (a notebook
            # re-running `m = Memory(..., other budgets)`); at exit, close_at_exit does it
            weakref.finalize(self, c.kv.close).atexit = False
            c.kv.start()  # jobs an earlier process left queued (a crash) are encoded now
        except BaseException:
            c.kv.close()
            raise
        self._register_open()

    @classmethod
    def from_config(cls, config: dict) -> "Memory":
        """Mem0-style constructor from a plain dict of :class:`MemoryConfig` fields.

        Raises:
            TypeError: ``config`` is not a dict; as :class:`Memory` otherwise.
        """
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict of MemoryConfig fields, got {type(config).__name__}")
        return cls(MemoryConfig(**config))

    def _scope(self, user_id: str | None, agent_id: str | None, run_id: str | None) -> Scope:
        self._check_open()
        return Scope.of(user_id, agent_id, run_id)

    # ------------------------------------------------------------------ writes

    def add(self, messages: str | dict | Sequence[dict], *, user_id: str | None = None, agent_id: str | None = None,
            run_id: str | None = None, metadata: dict | None = None, infer: bool = False,
            dedupe: bool = True) -> dict:
        """Remember ``messages`` (Mem0's ``add``).

        The messages are appended to the scope's turn log; with ``infer=False`` each
        message's content is stored as a fact whose provenance is its own turn. The call
        returns once Chroma, the index and the history hold the write; the facts' KV is
        queued (durably) and encoded in the background: until it is, a request prefills
        the fact as text. :meth:`wait_for_kv` waits for it.

        Args:
            messages: a string, a message dict (``{"role", "content"}``) or a list of them.
            metadata: attached to every stored fact (JSON-serialisable); or, with
                ``infer=False``, a list of one dict (or ``None``) per message, each attached to
                its message's memory (a key-value store's batch of items in one write).
            infer: ``False`` stores each message as given; ``True`` has the served LLM
                extract facts from the messages and reconciles each with the scope's
                stored facts (:mod:`inferscale.facts.extraction`).
            dedupe: ``True`` (default): a text the scope already holds is not stored again
                (a ``NOOP``, so loaders can be re-run); ``False``: every message is a new
                memory (``ADD``) even when the scope holds its text (a key-value store
                keeping one value under two keys). Only with ``infer=False``.

        Returns:
            ``{"results": [{"id", "memory", "event"}]}``, ``event`` one of ``"ADD"``,
            ``"UPDATE"`` (with ``previous_memory``), ``"DELETE"`` or ``"NOOP"`` (the same
            text is already stored in the scope).

        Raises:
            ValueError / TypeError: empty or non-string text, no scope, ``infer`` or
                ``dedupe`` not a bool, ``dedupe=False`` with ``infer=True``, a ``metadata``
                list whose length is not the number of messages, or given with
                ``infer=True`` (nothing is written).
        """
        self._check_open()
        turns = args.messages_to_turns(messages)  # validates everything before writing
        metas = args.per_message_metadata(metadata, len(turns), infer)
        meta = metas[0] if metas else args.check_metadata(metadata)
        check_bool("infer", infer)
        check_bool("dedupe", dedupe)
        if infer and not dedupe:
            raise ValueError("dedupe=False stores each message as given, so it needs infer=False (with infer=True "
                             "the reconciler decides what is new): pass infer=False, or leave dedupe=True")
        scope = Scope.of(user_id, agent_id, run_id)
        for i, m in enumerate(metas or [meta]):  # before the turns are logged
            try:
                scope.check_metadata(m)
            except ValueError as exc:
                raise ValueError(f"metadata[{i}]: {exc}" if metas else str(exc)) from None
        c = self.components
        if infer:
            c.requests.check_prompt_chars([t.content for t in turns])  # before anything is tokenized
            logged = c.turns.append(scope.key, turns)
            try:
                return write_results(extract_and_reconcile(c.facts, scope, logged, meta, self.extractor,
                                                           self.reconciler, self._chat))
            except BaseException:  # the extraction failed (e.g. a message too long for the model):
                c.turns.delete(scope.key, [t.turn_id for t in logged])  # the call leaves nothing behind
                raise
        for i, t in enumerate(turns):
            c.facts.check_length(t.content, f"message {i}")
        with c.facts.transaction():
            logged = c.turns.append(scope.key, turns)
            return write_results(c.facts.add(scope, [FactInput(t.content, (t.turn_id,), m)
                                                     for t, m in zip(logged, metas or [meta] * len(logged))],
                                             dedupe=dedupe))

    def _chat(self, messages: list[dict]) -> str:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.engine.generate(ids, max_tokens=256, temperature=0.0).text

    def log_turns(self, messages: Sequence[dict], *, user_id: str | None = None, agent_id: str | None = None,
                  run_id: str | None = None) -> list[Turn]:
        """Append raw turns to the scope's log without storing facts.

        Args:
            messages: dicts with ``content`` and optional ``role`` (default ``"user"``),
                ``name``, ``id`` (turn id, unique in the scope) and ``metadata``.

        Raises:
            ValueError / TypeError: a message is malformed, or an id is reused (nothing is logged).
        """
        scope = self._scope(user_id, agent_id, run_id)
        return self.components.turns.append(scope.key, args.message_list_to_turns(messages))

    def update(self, memory_id: str, data: str, *, user_id: str | None = None, agent_id: str | None = None,
               run_id: str | None = None, metadata: dict | None = None, dedupe: bool = True) -> dict:
        """Replace a memory's text (and metadata, when given); its KV is invalidated everywhere.

        Args:
            dedupe: ``True`` (default): refuse a new text another memory of the scope holds;
                ``False``: take it (as :meth:`add` with ``dedupe=False``).

        Returns:
            ``{"message": "Memory updated successfully!", "id", "memory"}``.

        Raises:
            inferscale.types.MemoryNotFoundError: no such memory in this scope.
            ValueError: empty text, or (``dedupe=True``) the new text duplicates another
                memory of the scope.
            TypeError: ``dedupe`` not a bool.
        """
        scope = self._scope(user_id, agent_id, run_id)
        check_id("memory_id", memory_id)
        check_bool("dedupe", dedupe)
        rec = self.components.facts.update(scope, memory_id, data,
                                           None if metadata is None else args.check_metadata(metadata), dedupe=dedupe)
        return {"message": "Memory updated successfully!", "id": rec.id, "memory": rec.text}

    def update_metadata(self, memory_id: str, metadata: dict, *, user_id: str | None = None,
                        agent_id: str | None = None, run_id: str | None = None) -> dict:
        """Set top-level fields of a memory's metadata, keeping its other fields (a field
        given as ``None`` is removed, as in a JSON merge patch). Its text, embedding, KV and
        ``updated_at`` stay: nothing is embedded and the memory's KV stays valid (an expiry
        or a tag can change on every read at the cost of one metadata write). The merge runs
        under the scope's lock, so concurrent patches of one memory, from any process over
        the store, keep each other's fields. The history records an ``UPDATE`` whose text is
        unchanged.

        Args:
            metadata: the fields to set (``None`` values: fields to remove); at least one.

        Returns:
            ``{"message": "Memory metadata updated successfully!", "id", "metadata"}`` (the
            memory's metadata as now stored).

        Raises:
            inferscale.types.MemoryNotFoundError: no such memory in this scope.
            TypeError: ``metadata`` not a dict, a non-string key, a value JSON cannot hold.
            ValueError: an empty ``metadata``, NaN or Infinity, a reserved key (``created_at``,
                ``updated_at``), nesting deeper than metadata may be.

        Example:
            >>> memory.update_metadata(memory_id, {"expires_at": 4102444800.0, "draft": None}, user_id="alice")
        """
        scope = self._scope(user_id, agent_id, run_id)
        check_id("memory_id", memory_id)
        rec = self.components.facts.update_metadata(scope, memory_id, args.check_metadata_patch(metadata))
        return {"message": "Memory metadata updated successfully!", "id": rec.id, "metadata": rec.to_item()["metadata"]}

    def delete(self, memory_id: str, *, user_id: str | None = None, agent_id: str | None = None,
               run_id: str | None = None) -> dict:
        """Delete one memory of the scope (and its KV).

        Raises:
            inferscale.types.MemoryNotFoundError: no such memory in this scope.
        """
        scope = self._scope(user_id, agent_id, run_id)
        check_id("memory_id", memory_id)
        self.components.facts.delete(scope, [memory_id])
        return {"message": "Memory deleted successfully!"}

    def delete_all(self, *, user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None) -> dict:
        """Delete every memory of the scope and its chat reports (its turn log stays)."""
        scope = self._scope(user_id, agent_id, run_id)
        n = len(self.components.facts.delete_all(scope))
        self.components.chats.delete_scope(scope.key)  # its chat reports quote the memories
        return {"message": f"{n} {'memory' if n == 1 else 'memories'} deleted successfully!"}

    def reset(self) -> None:
        """Delete everything in the data dir's store: every scope's memories, turns, history, chat
        reports and KV."""
        self._check_open()
        self.components.facts.reset(self.components.turns)
        self.components.chats.clear()

    def delete_turns(self, turn_ids: Sequence[str], *, user_id: str | None = None, agent_id: str | None = None,
                     run_id: str | None = None) -> int:
        """Delete turns of the scope's log by id; returns how many existed. Memories derived
        from them stay (:meth:`delete` those); their KV is re-encoded without the deleted
        turns' context when next served.

        Raises:
            TypeError: ``turn_ids`` is not a list of strings.
        """
        scope = self._scope(user_id, agent_id, run_id)
        return self.components.facts.delete_turns(scope, self.components.turns, args.check_turn_ids(turn_ids))

    # ------------------------------------------------------------------ reads

    def get(self, memory_id: str, *, user_id: str | None = None, agent_id: str | None = None,
            run_id: str | None = None) -> dict:
        """One memory of the scope.

        Raises:
            inferscale.types.MemoryNotFoundError: no such memory in this scope.
        """
        scope = self._scope(user_id, agent_id, run_id)
        check_id("memory_id", memory_id)
        return self.components.facts.get(scope, memory_id).to_item()

    def search(self, query: str, *, user_id: str | None = None, agent_id: str | None = None,
               run_id: str | None = None, limit: int | None = None, threshold: float | None = None,
               filters: dict | None = None, mode: str | None = None, top_k: int | None = None,
               show_expired: bool = False) -> dict:
        """The scope's facts best matching ``query``: hybrid (cosine and BM25 keyword ranks
        fused) or dense (exact cosine) top-``limit``.

        The scope: keywords (``user_id="alice"``, Mem0 2.x) and/or ``filters={"user_id": ...}`` (Mem0 now).

        Args:
            limit / top_k: most results (default 100; ``top_k``: Mem0's current name). threshold: least cosine.
            filters: metadata filters (:mod:`inferscale.store.filters`); a field no memory has
                matches nothing. Top-level ``user_id`` / ``agent_id`` / ``run_id`` keys are
                the scope, not metadata.
            mode: ``"hybrid"`` or ``"dense"`` (default: ``config.search_mode``, hybrid).
            show_expired: also find memories whose ``metadata["expires_at"]`` has passed (Mem0's name).

        Returns:
            ``{"results": [{"id", "memory", "score", "metadata", ...}]}``, best first; empty
            for a scope with no facts. ``score`` is the cosine similarity in both modes;
            under ``"hybrid"`` the order is the fused rank, so scores need not descend.

        Raises:
            ValueError: empty query, bad ``limit`` / ``threshold`` / ``mode``, ``limit`` and
                ``top_k`` that disagree, malformed filters, a scope in ``filters`` that is not a
                string or disagrees with the keyword.
        """
        self._check_open()
        scope, filters = args.scope_and_filters(user_id, agent_id, run_id, filters)
        limit = result_limit(limit, top_k)
        hits = self.components.facts.search(scope, query, limit, threshold, filters, mode, show_expired)
        return SearchResults([r.to_item(s) for r, s in hits], query, mode or self.config.search_mode)

    def get_all(self, *, user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None,
                limit: int | None = None, filters: dict | None = None, top_k: int | None = None) -> dict:
        """Every fact of the scope matching ``filters``, oldest first, at most ``limit`` (or
        ``top_k``, Mem0's current name; default 100); the scope as keywords or inside
        ``filters``, as :meth:`search` takes it."""
        self._check_open()
        scope, filters = args.scope_and_filters(user_id, agent_id, run_id, filters)
        limit = result_limit(limit, top_k)
        return {"results": [r.to_item() for r in self.components.facts.list(scope, filters)[:limit]]}

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Stop the background encoder (queued encodes stay queued for the next start) and the
        engine this memory started (an engine given to the constructor is left running). In a
        forked child it only marks the child's copy closed: the store and the engine are the parent's."""
        if self._pid != os.getpid():
            self._closed = True
            return
        self.components.kv.close()
        self.components.store.close()  # a re-embed may run now
        with self._engine_lock:
            self._closed = True
            if self._owns_engine and self._engine is not None:
                with when_slow("stopping vLLM's engine (its worker ends: about 10 s on a CPU)"):
                    self._engine.close()
                self._engine = None

    def __enter__(self) -> "Memory":
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
