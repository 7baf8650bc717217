"""``Memory``: the Mem0-style facade.

Write path (:meth:`Memory.add`, :meth:`Memory.add_facts`): raw turns go to the scope's
turn log; facts are embedded, written to Chroma (the system of record) first, then to
the device index, then their KV is encoded at the default context window and put in
the KV pool (:class:`inferscale.facts.FactService`). Serve path (:meth:`Memory.inject`,
:meth:`Memory.generate`): embed the query, exact top-k in the scope's partition, build
the prompt, make sure every retrieved fact's KV is in the pool, and hand vLLM the token
ids plus the ``kv_transfer_params`` its connector reads
(:class:`inferscale.serve_path.ServePath`).

Every call is scoped by ``user_id`` / ``agent_id`` / ``run_id`` (at least one), by-id
calls included: another scope's memory id is "not found".
"""

from __future__ import annotations

import copy
import dataclasses
import json
import threading
from pathlib import Path
from typing import Any, Iterator, Sequence

from inferscale.checks import (MAX_CONTEXT_WINDOW, check_bool, check_id, check_int, check_role, first_line,
                               result_limit)
from inferscale.config import MemoryConfig
from inferscale.embedded_store import MANIFEST, embedded_count, hidden_memories_message, moved_message
from inferscale.embedding import Embedder
from inferscale.extraction import (
    FactExtractor,
    LLMFactExtractor,
    Reconciler,
    SimilarityReconciler,
    extract_and_reconcile,
)
from inferscale.facts import FactService
from inferscale.filters import MAX_DEPTH as MAX_FILTER_DEPTH
from inferscale.history import HistoryLog
from inferscale.index import VectorIndex
from inferscale.kv.encoder import best_device
from inferscale.kv.jobs import KVJobQueue
from inferscale.kv.manager import KVManager
from inferscale.kv.pool import FactKV, KVPool
from inferscale.kv.reference import ReferenceModel
from inferscale.lifecycle import close_at_exit
from inferscale.models import model_fingerprint, resolve_embedder, resolve_llm
from inferscale.options import GenerationOptions
from inferscale.prompt import PromptBuilder
from inferscale.serve_path import PreparedRequest, ServePath, run
from inferscale.sql import Database
from inferscale.store import SCHEMA_VERSION, FactRecord, FactStore, Scope, StoreError
from inferscale.tools import parse_tool_calls
from inferscale.turns import Turn, TurnLog
from inferscale.types import (
    FactInput,
    Generation,
    GenerationChunk,
    Injection,
    MemoryNotFoundError,
    WriteEvent,
    require_text,
)



#: Longest ``wait_for_kv`` timeout accepted, in seconds (a year; ``None`` waits without limit).
MAX_TIMEOUT_S = 365 * 24 * 3600.0

#: The scope's fields, which Mem0's current API also takes inside ``filters``.
SCOPE_FIELDS = frozenset({"user_id", "agent_id", "run_id"})


class Memory:
    """Persistent per-user memory served to vLLM as precomputed KV.

    Args:
        config: a :class:`~inferscale.config.MemoryConfig` (default: defaults plus
            ``INFERSCALE_*`` environment variables).
        engine: an existing :class:`~inferscale.serving.engine.Engine` whose connector reads
            this data dir's KV pool (default: one is started on first use).
        extractor: fact extraction for ``add(infer=True)`` (default :class:`LLMFactExtractor`).
        reconciler: ADD/UPDATE/DELETE/NOOP decisions (default :class:`SimilarityReconciler`).
        **overrides: fields of the config, e.g. ``Memory(data_dir="./mem", dtype="float32")``.

    Raises:
        inferscale.models.ModelNotFoundError: the LLM or embedder cannot be found.
        inferscale.store.StoreError: the data dir cannot be used (unwritable, written by a
            newer version, or with another embedder).
        pydantic.ValidationError: an unknown or invalid config field.

    Example:
        >>> m = Memory(data_dir="./mem")
        >>> m.add("I am allergic to peanuts.", user_id="alice")
        >>> m.generate("What should I avoid eating?", user_id="alice").text
    """

    def __init__(self, config: MemoryConfig | None = None, *, engine=None, extractor: FactExtractor | None = None,
                 reconciler: Reconciler | None = None, **overrides: Any) -> None:
        if isinstance(config, dict):  # Mem0's Memory.from_config(dict) style
            config = MemoryConfig(**config)
        if config is not None and not isinstance(config, MemoryConfig):
            raise TypeError(f"config must be a MemoryConfig or a dict of its fields, got {type(config).__name__}: "
                            "pass settings as keywords, e.g. Memory(data_dir='./mem')")
        if config is None:  # keywords win over INFERSCALE_* variables, which fill in the rest
            self.config = MemoryConfig(**overrides)
        else:
            self.config = MemoryConfig(**{**config.model_dump(exclude_unset=True), **overrides}) if overrides else config
        data = self.config.data_dir
        # everything that can fail without touching the data dir comes first
        self.model_path = resolve_llm(self.config.llm)
        embedder_source = resolve_embedder(self.config.embedder)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        self.prompts = PromptBuilder(self.tokenizer, self.config.system_prompt)
        self.kv_dir = data / "kv"
        if engine is not None and not hasattr(engine, "kv_dir"):
            raise TypeError(f"engine must be an inferscale.serving.engine.Engine, got {type(engine).__name__}")
        if extractor is not None and not callable(extractor):
            raise TypeError(f"extractor must be callable as extractor(turns, chat) (inferscale.extraction.FactExtractor), "
                            f"got {type(extractor).__name__}")
        if reconciler is not None and not callable(getattr(reconciler, "decide", None)):
            raise TypeError(f"reconciler must have a decide() method (inferscale.extraction.Reconciler), "
                            f"got {type(reconciler).__name__}")
        if engine is not None and Path(engine.kv_dir).resolve() != self.kv_dir.resolve():
            raise ValueError(f"the given engine serves KV from {engine.kv_dir}, not this memory's {self.kv_dir}")
        manifest = self._check_data_dir(data)
        self.device = best_device()
        if self.config.chroma_url is not None and not self.config.hide_embedded_memories:
            hidden = embedded_count(data)  # memories the server would hide: refused, never silently
            if hidden:
                raise StoreError(hidden_memories_message(data, hidden, self.config.chroma_url))
        try:
            self.store = FactStore(data / "chroma", self.config.chroma_server())
            if self.config.database_url is None:  # the embedded default: two SQLite files in the data dir
                self.turns = TurnLog(Database.sqlite_file(data / "turns.sqlite"))
                self.history_log = HistoryLog(Database.sqlite_file(data / "history.sqlite"))
            else:  # one database many processes share (PostgreSQL)
                shared = Database(self.config.database_url)
                try:
                    self.turns, self.history_log = TurnLog(shared), HistoryLog(shared)
                except Exception as exc:  # noqa: BLE001 - sqlalchemy.exc.OperationalError and kin
                    raise StoreError(f"cannot use the database at {shared.describe()} ({first_line(exc)}): check "
                                     "database_url and that the server is running") from None
            self.kv_jobs = KVJobQueue(data / "kv_jobs.sqlite")
            self.pool = KVPool.shared(self.kv_dir, self.device, self.config.device_kv_budget_bytes)
        except (StoreError, ImportError):
            raise
        except Exception as exc:  # sqlite, chromadb and OS errors on a damaged store
            raise StoreError(f"cannot open the store at {data} ({type(exc).__name__}: {exc}): move the damaged "
                             "file aside or choose another data_dir") from exc
        if manifest is not None:
            (data / MANIFEST).write_text(json.dumps(manifest, indent=2))
        self.embedder = Embedder(self.config.embedder, self.device, source=embedder_source,
                                 backend=self.config.embedder_backend)
        # partitions load on first use, and catch up on (or reload after) other processes' writes
        self.index = VectorIndex(self.device, loader=self.store.load_scope, versioner=self.history_log.scope_version,
                                 changes=self.history_log.changes_since, fetch=self.store.fetch)
        self.kv = KVManager(
            self.model_path, model_fingerprint(self.model_path), self.config.resolved_dtype, self.prompts, self.pool,
            self.turns, self.config.encode_batch_tokens, self.config.max_model_len,
            jobs=self.kv_jobs, store=self.store, verbose=self.config.verbose,
        )
        self.facts = FactService(self.store, self.index, self.embedder, self.kv, self.history_log,
                                 self.config.context_window, self.config.precompute_kv, self.config.max_fact_tokens,
                                 self.config.search_mode)
        self._engine = engine
        self.extractor = extractor or LLMFactExtractor()
        self.reconciler = reconciler or SimilarityReconciler()
        self._engine_lock = threading.Lock()
        self._owns_engine = engine is None
        self._closed = False
        self.serve = ServePath(self.facts, self.prompts, self.kv, self.turns, self.config.max_model_len)
        close_at_exit(self, first=True)  # a script that never calls close() still exits cleanly
        self.kv.start()  # jobs an earlier process left queued (a crash) are encoded now

    def _check_data_dir(self, data: Path) -> dict | None:
        """Create the data dir, check it is writable and check its manifest (schema version,
        embedder). Returns the manifest to write once the store opened, or ``None`` if one exists."""
        try:
            data.mkdir(parents=True, exist_ok=True)
            probe = data / ".write-test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as exc:
            raise StoreError(f"cannot use data_dir {data}: {exc}. Choose a writable folder.") from exc
        path = data / MANIFEST
        manifest = {"schema_version": SCHEMA_VERSION, "embedder": self.config.embedder}
        if path.exists():
            try:
                found = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise StoreError(f"{path} is not valid JSON ({exc}); it is InferScale's store manifest") from exc
            if found.get("schema_version", 0) > SCHEMA_VERSION:
                raise StoreError(f"the store at {data} has schema version {found['schema_version']}, newer than this "
                                 f"InferScale's {SCHEMA_VERSION}: upgrade inferscale to open it")
            moved = moved_message(data, found) if self.config.chroma_url is None else None
            if moved:  # its memories are on a server: the empty embedded store would hide them
                raise StoreError(moved)
            if found.get("embedder") != self.config.embedder:
                raise StoreError(f"the store at {data} was built with embedder {found.get('embedder')!r}, not "
                                 f"{self.config.embedder!r}: open it with embedder={found.get('embedder')!r} or use "
                                 "another data_dir")
            return None
        return manifest

    @classmethod
    def from_config(cls, config: dict) -> "Memory":
        """Mem0-style constructor from a plain dict of :class:`MemoryConfig` fields.

        Raises:
            TypeError: ``config`` is not a dict; as :class:`Memory` otherwise.
        """
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict of MemoryConfig fields, got {type(config).__name__}")
        return cls(MemoryConfig(**config))

    # ------------------------------------------------------------------ writes

    def log_turns(self, messages: Sequence[dict], *, user_id: str | None = None, agent_id: str | None = None,
                  run_id: str | None = None) -> list[Turn]:
        """Append raw turns to the scope's log without storing facts.

        Args:
            messages: dicts with ``content`` and optional ``role`` (default ``"user"``),
                ``name``, ``id`` (turn id, unique in the scope) and ``metadata``.

        Raises:
            ValueError / TypeError: a message is malformed, or an id is reused (nothing is logged).
        """
        self._check_open()
        scope = Scope.of(user_id, agent_id, run_id)
        if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence):
            raise TypeError(f"messages must be a list of message dicts, got {type(messages).__name__}")
        return self.turns.append(scope.key, [_turn(i, m) for i, m in enumerate(messages)])

    def add(self, messages: str | dict | Sequence[dict], *, user_id: str | None = None, agent_id: str | None = None,
            run_id: str | None = None, metadata: dict | None = None, infer: bool = False) -> dict:
        """Remember ``messages`` (Mem0's ``add``).

        The messages are appended to the scope's turn log; with ``infer=False`` each
        message's content is stored as a fact whose provenance is its own turn. The call
        returns once Chroma, the index and the history hold the write; the facts' KV is
        queued (durably) and encoded in the background: until it is, a request prefills
        the fact as text. :meth:`wait_for_kv` waits for it.

        Args:
            messages: a string, a message dict (``{"role", "content"}``) or a list of them.
            metadata: attached to every stored fact (JSON-serialisable).
            infer: ``False`` stores each message as given; ``True`` has the served LLM
                extract facts from the messages and reconciles each with the scope's
                stored facts (:mod:`inferscale.extraction`).

        Returns:
            ``{"results": [{"id", "memory", "event"}]}``, ``event`` one of ``"ADD"``,
            ``"UPDATE"`` (with ``previous_memory``), ``"DELETE"`` or ``"NOOP"`` (the same
            text is already stored in the scope).

        Raises:
            ValueError / TypeError: empty or non-string text, no scope (nothing is written).
        """
        self._check_open()
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        elif isinstance(messages, dict):
            messages = [messages]
        if isinstance(messages, bytes) or not isinstance(messages, Sequence):
            raise TypeError("messages must be a string, a message dict or a list of message dicts, "
                            f"got {type(messages).__name__}")
        if not messages:
            raise ValueError("messages is empty: give a string, a message dict or a list of message dicts")
        turns = [_turn(i, m) for i, m in enumerate(messages)]  # validates everything before writing
        meta = _check_metadata(metadata)
        check_bool("infer", infer)
        scope = Scope.of(user_id, agent_id, run_id)
        if not infer:
            for i, t in enumerate(turns):
                self.facts.check_length(t.content, f"message {i}")
        if infer:
            logged = self.turns.append(scope.key, turns)
            try:
                return _results(extract_and_reconcile(self.facts, scope, logged, meta, self.extractor,
                                                      self.reconciler, self._chat))
            except BaseException:  # the extraction failed (e.g. a message too long for the model):
                self.turns.delete(scope.key, [t.turn_id for t in logged])  # the call leaves nothing behind
                raise
        with self.facts.transaction():
            logged = self.turns.append(scope.key, turns)
            facts = [FactInput(t.content, (t.turn_id,), meta) for t in logged]
            return _results(self.facts.add(scope, facts))

    def _chat(self, messages: list[dict]) -> str:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.engine.generate(ids, max_tokens=256, temperature=0.0).text

    def add_facts(self, facts: Sequence[FactInput | str], *, user_id: str | None = None, agent_id: str | None = None,
                  run_id: str | None = None, encode_kv: bool = True, context_window: int | None = None) -> dict:
        """Store facts with provenance (LoCoMo observations, extracted facts).

        Args:
            facts: :class:`FactInput` s (or plain strings, without provenance).
            encode_kv: encode each fact's KV now (else on first use).
            context_window: w to encode it at (default ``config.context_window``).

        Returns:
            ``{"results": [{"id", "memory", "event"}]}`` as :meth:`add`.

        Raises:
            ValueError / TypeError: empty text, or a source turn id not in the scope's log.
        """
        self._check_open()
        scope = Scope.of(user_id, agent_id, run_id)
        check_bool("encode_kv", encode_kv)
        check_int("context_window", context_window, optional=True, unit="turns", maximum=MAX_CONTEXT_WINDOW)
        if isinstance(facts, (str, bytes, FactInput)) or not isinstance(facts, Sequence):
            raise TypeError(f"facts must be a list of FactInput or strings, got {type(facts).__name__}")
        inputs = [FactInput(f) if isinstance(f, str) else f for f in facts]
        for i, f in enumerate(inputs):
            if not isinstance(f, FactInput):
                raise TypeError(f"fact {i} must be a FactInput or a string, got {type(f).__name__}")
            require_text(f.text, f"fact {i} text")
            inputs[i] = dataclasses.replace(f, metadata=_check_metadata(f.metadata))  # None -> {}
            ids = f.source_turn_ids
            if isinstance(ids, str) or not isinstance(ids, (tuple, list)) or not all(
                    isinstance(t, str) and t for t in ids):
                raise TypeError(f"fact {i} source_turn_ids must be a tuple of turn id strings, got {ids!r}")
        wanted = sorted({t for f in inputs for t in f.source_turn_ids})
        known = self.turns.get(scope.key, wanted)
        if len(known) != len(wanted):
            missing = [t for t in wanted if t not in known]
            raise ValueError(f"source turn ids {missing[:5]} are not in this scope's log: log them with log_turns first")
        return _results(self.facts.add(scope, inputs, encode_kv=encode_kv, context_window=context_window))

    def find_texts(self, texts: Sequence[str], *, user_id: str | None = None, agent_id: str | None = None,
                   run_id: str | None = None) -> dict[str, str]:
        """Map each of ``texts`` that the scope already stores (exact text) to its memory id.

        Raises:
            TypeError / ValueError: ``texts`` is not a list of non-empty strings.
        """
        self._check_open()
        if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
            raise TypeError(f"texts must be a list of strings, got {type(texts).__name__}")
        for i, t in enumerate(texts):
            require_text(t, f"texts[{i}]")
        return self.facts.find_texts(Scope.of(user_id, agent_id, run_id), list(texts))

    def count_turns(self, *, user_id: str | None = None, agent_id: str | None = None,
                    run_id: str | None = None) -> int:
        """How many turns the scope's conversation log holds."""
        self._check_open()
        return self.turns.count(Scope.of(user_id, agent_id, run_id).key)

    def fact_tokens(self, text: str) -> int:
        """Tokens a memory with this text occupies in a prompt (its ``"- <text>\\n"`` line)."""
        self._check_open()
        return self.kv.fact_tokens(require_text(text, "text"))

    def kv_footprint(self) -> dict[str, int]:
        """Bytes of fact KV held by this process's pool: ``{"device": ..., "disk": ...}``."""
        self._check_open()
        return self.pool.footprint()

    def encode_preamble(self) -> None:
        """Encode the prompt preamble's KV now (it is otherwise encoded with the first fact)."""
        self._check_open()
        self.kv.ensure([self.kv.preamble_span()])

    def injected_kv(self, injection: Injection) -> list[tuple[int, FactKV]]:
        """The KV an injection supplies, as ``(start position, FactKV)`` per segment, for the
        transformers reference path (:class:`~inferscale.kv.reference.ReferenceModel`).

        Raises:
            TypeError: ``injection`` is not what :meth:`inject` returned.
            ValueError: a text-mode injection (no plan), or a segment no longer in the pool.
        """
        self._check_open()
        if not isinstance(injection, Injection):
            raise TypeError(f"injection must be what Memory.inject returns, got {type(injection).__name__}")
        if injection.plan is None:
            raise ValueError("a text-mode request injects no KV")
        out = []
        for seg in injection.plan.segments:
            kv = self.pool.get(seg.key)
            if kv is None:
                raise ValueError(f"KV {seg.key} is no longer in the pool (its memory changed): prepare the request again")
            out.append((seg.start, kv))
        return out

    def reference_model(self) -> ReferenceModel:
        """The transformers reference path over this memory's KV encoder (loaded on first use)."""
        self._check_open()
        return ReferenceModel(self.kv.encoder)

    def check_fact_length(self, text: str, what: str = "fact") -> None:
        """Refuse a fact longer than ``config.max_fact_tokens`` (raises ``ValueError`` with the fix)."""
        self._check_open()
        self.facts.check_length(require_text(text, what), what)

    def count(self, *, user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None) -> int:
        """How many memories the scope holds."""
        self._check_open()
        return self.facts.count(Scope.of(user_id, agent_id, run_id))

    def update(self, memory_id: str, data: str, *, user_id: str | None = None, agent_id: str | None = None,
               run_id: str | None = None, metadata: dict | None = None) -> dict:
        """Replace a memory's text (and metadata, when given); its KV is invalidated everywhere.

        Returns:
            ``{"message": "Memory updated successfully!", "id", "memory"}``.

        Raises:
            inferscale.types.MemoryNotFoundError: no such memory in this scope.
            ValueError: empty text, or the text duplicates another memory of the scope.
        """
        self._check_open()
        check_id("memory_id", memory_id)
        rec = self.facts.update(Scope.of(user_id, agent_id, run_id), memory_id, data,
                                None if metadata is None else _check_metadata(metadata))
        return {"message": "Memory updated successfully!", "id": rec.id, "memory": rec.text}

    def delete(self, memory_id: str, *, user_id: str | None = None, agent_id: str | None = None,
               run_id: str | None = None) -> dict:
        """Delete one memory of the scope (and its KV).

        Raises:
            inferscale.types.MemoryNotFoundError: no such memory in this scope.
        """
        self._check_open()
        check_id("memory_id", memory_id)
        self.facts.delete(Scope.of(user_id, agent_id, run_id), [memory_id])
        return {"message": "Memory deleted successfully!"}

    def delete_all(self, *, user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None) -> dict:
        """Delete every memory of the scope (its turn log stays)."""
        self._check_open()
        scope = Scope.of(user_id, agent_id, run_id)
        deleted = self.facts.delete_all(scope)
        n = len(deleted)
        return {"message": f"{n} {'memory' if n == 1 else 'memories'} deleted successfully!"}

    def reset(self) -> None:
        """Delete everything in the data dir's store: every scope's memories, turns, history and KV."""
        self._check_open()
        self.facts.reset(self.turns)

    # ------------------------------------------------------------------ reads

    @staticmethod
    def _item(rec: FactRecord, score: float | None = None) -> dict:
        item = {
            "id": rec.id, "memory": rec.text, "hash": rec.hash, "metadata": copy.deepcopy(rec.metadata),
            "source_turn_ids": list(rec.source_turn_ids), "created_at": rec.created_at,
            "updated_at": rec.updated_at, **rec.scope.as_dict(),
        }
        if score is not None:
            item["score"] = score
        return item

    def get(self, memory_id: str, *, user_id: str | None = None, agent_id: str | None = None,
            run_id: str | None = None) -> dict:
        """One memory of the scope.

        Raises:
            inferscale.types.MemoryNotFoundError: no such memory in this scope.
        """
        self._check_open()
        check_id("memory_id", memory_id)
        return self._item(self.facts.get(Scope.of(user_id, agent_id, run_id), memory_id))

    def search(self, query: str, *, user_id: str | None = None, agent_id: str | None = None,
               run_id: str | None = None, limit: int | None = None, threshold: float | None = None,
               filters: dict | None = None, mode: str | None = None, top_k: int | None = None) -> dict:
        """The scope's facts best matching ``query``: hybrid (cosine and BM25 keyword ranks
        fused) or dense (exact cosine) top-``limit``.

        The scope is given as keywords (``user_id="alice"``, Mem0 2.x) or inside ``filters``
        (``filters={"user_id": "alice"}``, Mem0's current style), or both when they agree.

        Args:
            limit / top_k: most results (default 100); ``top_k`` is Mem0's current name for it.
            threshold: minimum cosine similarity of a result.
            filters: metadata filters (:mod:`inferscale.filters`); a field no memory has
                matches nothing. Top-level ``user_id`` / ``agent_id`` / ``run_id`` keys are
                the scope, not metadata.
            mode: ``"hybrid"`` or ``"dense"`` (default: ``config.search_mode``, hybrid).

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
        scope, filters = scope_and_filters(user_id, agent_id, run_id, filters)
        hits = self.facts.search(scope, query, result_limit(limit, top_k), threshold, filters, mode)
        return {"results": [self._item(r, s) for r, s in hits]}

    def get_all(self, *, user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None,
                limit: int | None = None, filters: dict | None = None, top_k: int | None = None) -> dict:
        """Every fact of the scope matching ``filters``, oldest first, at most ``limit`` (or
        ``top_k``, Mem0's current name; default 100); the scope as keywords or inside
        ``filters``, as :meth:`search` takes it."""
        self._check_open()
        scope, filters = scope_and_filters(user_id, agent_id, run_id, filters)
        limit = result_limit(limit, top_k)
        return {"results": [self._item(r) for r in self.facts.list(scope, filters)[:limit]]}

    def history(self, memory_id: str, *, user_id: str | None = None, agent_id: str | None = None,
                run_id: str | None = None) -> list[dict]:
        """The ADD / UPDATE / DELETE events of a memory of the scope, oldest first.

        Raises:
            inferscale.types.MemoryNotFoundError: the scope never held this memory.
        """
        self._check_open()
        check_id("memory_id", memory_id)
        scope = Scope.of(user_id, agent_id, run_id)
        events = self.history_log.events(scope.key, memory_id)
        if not events:
            raise MemoryNotFoundError(f"memory {memory_id!r} not found for {scope.as_dict()}")
        return [e.to_dict() for e in events]

    # ------------------------------------------------------------------ serving

    @property
    def engine(self):
        """The vLLM engine with InferScale's connector (:class:`~inferscale.serving.engine.Engine`,
        started on first use; stopped by :meth:`close`).

        Raises:
            RuntimeError: this memory was closed.
        """
        with self._engine_lock:
            if self._closed:
                raise RuntimeError("this Memory was closed: open a new Memory(...) over the same data_dir")
            if self._engine is None:
                from inferscale.serving.engine import Engine

                self._engine = Engine(
                    self.model_path, dtype=self.config.resolved_dtype, kv_dir=self.kv_dir,
                    max_model_len=self.config.max_model_len, kv_cache_memory_bytes=self.config.kv_cache_memory_bytes,
                    device_budget_bytes=self.config.device_kv_budget_bytes, verbose=self.config.verbose,
                )
            return self._engine

    def wait_for_kv(self, timeout: float | None = None) -> bool:
        """Block until the background encoder has encoded every queued KV (writes return
        before their KV exists: see :meth:`add`).

        Args:
            timeout: most seconds to wait (``None``: no limit).

        Returns:
            ``True`` when nothing is pending, ``False`` if ``timeout`` passed first (or at
            once when this memory was closed: the queued encodes wait for the next start).

        Raises:
            TypeError / ValueError: ``timeout`` is not ``None`` or a finite number >= 0.
        """
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))):
            raise TypeError(f"timeout must be seconds (a number) or None, got {timeout!r}")
        if timeout is not None and not 0 <= timeout <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout must be between 0 and {MAX_TIMEOUT_S:g} seconds (None: no limit), got {timeout!r}")
        return self.kv.wait(timeout)

    def pending_kv(self) -> int:
        """How many ``(memory, context window)`` KV encodings are queued."""
        return self.kv.pending()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Memory was closed: open a new Memory(...) over the same data_dir")

    def close(self) -> None:
        """Stop the background encoder (queued encodes stay queued for the next start) and the
        engine this memory started (an engine given to the constructor is left running)."""
        self.kv.close()
        with self._engine_lock:
            self._closed = True
            if self._owns_engine and self._engine is not None:
                self._engine.close()
                self._engine = None

    def __enter__(self) -> "Memory":
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def options(self, options: GenerationOptions | None = None, **overrides: Any) -> GenerationOptions:
        """Generation options with ``overrides`` applied and ``k`` / ``context_window`` resolved
        to this memory's defaults (``config.top_k`` / ``config.context_window``).

        Raises:
            TypeError: an override is not an option. ValueError: a bad value.
        """
        if options is not None and not isinstance(options, GenerationOptions):
            raise TypeError(f"options must be a GenerationOptions, got {type(options).__name__}: pass fields as "
                            "keyword arguments (k=5) or options=GenerationOptions(k=5)")
        o = (options or GenerationOptions()).merged(**overrides)
        return o.merged(k=self.config.top_k if o.k is None else o.k,
                        context_window=self.config.context_window if o.context_window is None else o.context_window)

    def prepare(self, query: str, *, user_id: str | None = None, agent_id: str | None = None,
                run_id: str | None = None, history: Sequence[dict] | None = None, instructions: str | None = None,
                allow_unknown_scope: bool = False, options: GenerationOptions | None = None,
                followup: Sequence[dict] | None = None, **overrides: Any) -> Injection:
        """Retrieve and lay out one request without running it, in either mode (arguments as
        :meth:`generate`).

        In ``mode="inject"`` any missing KV is encoded first, so the request never falls
        back; in ``mode="text"`` the result has no ``plan`` and no ``kv_transfer_params``.
        """
        self._check_open()
        req = self._prepare(query, user_id, agent_id, run_id, history, instructions, allow_unknown_scope,
                            self.options(options, **overrides), followup)
        return Injection(prompt_token_ids=req.prompt_token_ids, plan=req.plan,
                         memories=[self._item(r, s) for r, s in req.hits], memory_tokens=req.memory_tokens,
                         retrieval_s=req.retrieval_s, kv_memory_ids=list(req.kv_memory_ids),
                         text_memory_ids=list(req.text_memory_ids))

    def inject(self, query: str, *, user_id: str | None = None, agent_id: str | None = None,
               run_id: str | None = None, k: int | None = None, context_window: int | None = None,
               wait_for_kv: bool = False) -> Injection:
        """Retrieve the scope's top-``k`` facts and prepare one vLLM request that injects their KV.

        Facts whose KV is not encoded yet are placed as text after the injected ones (see
        ``kv_memory_ids`` / ``text_memory_ids``) and queued for the background encoder.

        Args:
            k: facts to retrieve (default ``config.top_k``).
            context_window: w, in turns (default ``config.context_window``).
            wait_for_kv: encode missing KV first, so every fact is injected.

        Raises:
            UnknownScopeError: the scope has no memories and no turns.
            ValueError: empty query, negative k or w.
        """
        self._check_open()
        return self.prepare(query, user_id=user_id, agent_id=agent_id, run_id=run_id, k=k,
                            context_window=context_window, mode="inject", max_tokens=1, wait_for_kv=wait_for_kv)

    def _prepare(self, query, user_id, agent_id, run_id, history, instructions, allow_unknown_scope,
                 options: GenerationOptions, followup=None) -> PreparedRequest:
        return self.serve.prepare(Scope.of(user_id, agent_id, run_id), query, options, history=history,
                                  instructions=instructions, allow_unknown_scope=allow_unknown_scope,
                                  followup=followup)

    def generate(self, query: str, *, user_id: str | None = None, agent_id: str | None = None,
                 run_id: str | None = None, history: Sequence[dict] | None = None, instructions: str | None = None,
                 allow_unknown_scope: bool = False, options: GenerationOptions | None = None,
                 followup: Sequence[dict] | None = None, **overrides: Any) -> Generation:
        """Answer ``query`` with the scope's memory.

        Thread-safe: calls from several threads run concurrently and vLLM batches them.

        Args:
            history: earlier turns of the current conversation, ``{"role": "user" |
                "assistant" | "tool", "content"}`` dicts, oldest first (an assistant turn may
                carry ``"tool_calls"``); they are prefilled after the memory block, before ``query``.
            followup: turns after ``query``, as ``history``: the assistant's tool calls and
                the tools' results, when the model answers a question after calling tools.
            instructions: extra system text, placed after the memory block.
            allow_unknown_scope: answer a scope with no memories and no turns (a new user)
                without memories instead of raising ``UnknownScopeError``.
            options: a :class:`~inferscale.options.GenerationOptions`.
            **overrides: its fields one by one: ``k``, ``context_window``, ``mode``
                (``"inject"``: the memory block as precomputed KV; ``"text"``: the same
                tokens prefilled, Mem0-style), ``max_tokens`` (default 64), ``temperature``
                (0 is greedy), ``stop``, ``logprobs``, ``json_schema`` (constrained decoding),
                ``tools`` and ``tool_choice`` (:mod:`inferscale.tools`; the calls come back
                in ``Generation.tool_calls``).

        Raises:
            UnknownScopeError: the scope has no memories and no turns.
            TypeError: an unknown option. ValueError: a bad option value, an empty query, a
                bad history, or a prompt over ``max_model_len``.
        """
        self._check_open()
        for chunk in self.stream(query, user_id=user_id, agent_id=agent_id, run_id=run_id, history=history,
                                 instructions=instructions, allow_unknown_scope=allow_unknown_scope, options=options,
                                 followup=followup, **overrides):
            if chunk.generation is not None:
                return chunk.generation
        raise RuntimeError("the stream ended without a generation")

    def stream(self, query: str, *, user_id: str | None = None, agent_id: str | None = None,
               run_id: str | None = None, history: Sequence[dict] | None = None, instructions: str | None = None,
               allow_unknown_scope: bool = False, options: GenerationOptions | None = None,
               followup: Sequence[dict] | None = None, **overrides: Any) -> Iterator[GenerationChunk]:
        """:meth:`generate`, streamed: the same request, its text yielded as the engine produces it.

        Retrieval, input checks and KV encoding happen in this call (errors are raised
        here); the iterator runs the request. Closing it early aborts the request.

        Returns:
            An iterator of :class:`GenerationChunk`; their texts joined are the answer, and
            the last one carries the :class:`Generation` with its timings and counters.

        Example:
            >>> for chunk in m.stream("Suggest a snack for me.", user_id="alice"):
            ...     print(chunk.text, end="")
        """
        self._check_open()
        req = self._prepare(query, user_id, agent_id, run_id, history, instructions, allow_unknown_scope,
                            self.options(options, **overrides), followup)
        if req.json_schema is not None:  # refused here, not when the iterator first runs
            from inferscale.serving.vllm_compat import check_json_schema  # no engine needed: refused before one starts

            check_json_schema(req.json_schema)
        return self._chunks(self.engine, req, [self._item(r, s) for r, s in req.hits])

    @staticmethod
    def _chunks(engine, req: PreparedRequest, memories: list[dict]) -> Iterator[GenerationChunk]:
        for piece in run(engine, req):
            out = piece.output
            yield GenerationChunk(piece.delta, None if out is None else Generation(
                text=piece.text, mode=req.options.mode, ttft_s=out.ttft_s, latency_s=out.latency_s,
                retrieval_s=req.retrieval_s, num_prompt_tokens=out.num_prompt_tokens,
                num_injected_tokens=out.num_injected_tokens,
                num_prefilled_tokens=out.num_prompt_tokens - out.num_cached_tokens, memories=memories,
                first_logprobs=out.first_logprobs, num_generated_tokens=out.num_output_tokens,
                kv_memory_ids=list(req.kv_memory_ids), text_memory_ids=list(req.text_memory_ids),
                tool_calls=[c.to_dict() for c in parse_tool_calls(piece.text, req.options.offered_tools())],
                finish_reason=out.finish_reason,
            ))

    # ------------------------------------------------------------------ turns

    def get_turns(self, *, user_id: str | None = None, agent_id: str | None = None,
                  run_id: str | None = None) -> list[Turn]:
        """Every turn of the scope's conversation log, oldest first."""
        self._check_open()
        return self.turns.scope_turns(Scope.of(user_id, agent_id, run_id).key)

    def delete_turns(self, turn_ids: Sequence[str], *, user_id: str | None = None, agent_id: str | None = None,
                     run_id: str | None = None) -> int:
        """Delete turns of the scope's log by id; returns how many existed.

        Memories derived from them stay (delete those with :meth:`delete`); their KV is
        re-encoded without the deleted turns' context when next served.

        Raises:
            TypeError: ``turn_ids`` is not a list of strings.
        """
        self._check_open()
        scope = Scope.of(user_id, agent_id, run_id)
        if isinstance(turn_ids, (str, bytes)) or not isinstance(turn_ids, Sequence) or not all(
                isinstance(t, str) for t in turn_ids):
            raise TypeError(f"turn_ids must be a list of turn id strings, got {turn_ids!r}")
        return self.facts.delete_turns(scope, self.turns, list(turn_ids))


def scope_and_filters(user_id: str | None, agent_id: str | None, run_id: str | None,
                      filters: dict | None) -> tuple[Scope, dict | None]:
    """The scope from keywords and/or the top-level ``user_id`` / ``agent_id`` / ``run_id`` keys
    of Mem0-style ``filters``, and the filters left for metadata.

    Raises:
        ValueError: a scope key in ``filters`` is not a non-empty string (operators do not
            apply to the scope), or disagrees with the keyword of the same name; no scope.
    """
    nested = _nested_scope_key(filters.values() if isinstance(filters, dict) else ())
    if nested:
        raise ValueError(f"filters has {nested!r} inside an AND / OR / NOT: the scope goes at the top level "
                         f"(filters={{{nested!r}: ..., 'AND': [...]}}) or as a keyword ({nested}=...)")
    if not isinstance(filters, dict) or not SCOPE_FIELDS & filters.keys():
        return Scope.of(user_id, agent_id, run_id), filters
    given = {"user_id": user_id, "agent_id": agent_id, "run_id": run_id}
    rest = dict(filters)
    for name in SCOPE_FIELDS & filters.keys():
        value = rest.pop(name)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"filters[{name!r}] is the scope and must be a non-empty string, got {value!r}: "
                             "operators apply to metadata fields only")
        if given[name] is not None and given[name] != value:
            raise ValueError(f"{name}={given[name]!r} and filters[{name!r}]={value!r} disagree: give the scope once")
        given[name] = value
    return Scope.of(**given), rest or None


def _nested_scope_key(values, depth: int = 0) -> str | None:
    """A scope field used as a key below the top level of filters (inside a logical operator);
    nesting past the filters' own limit is left to :func:`inferscale.filters.compile_filter`."""
    if depth > MAX_FILTER_DEPTH:
        return None
    for value in values:
        children = value if isinstance(value, list) else [value]
        for child in children:
            if isinstance(child, dict):
                found = next((k for k in child if k in SCOPE_FIELDS), None) or _nested_scope_key(child.values(),
                                                                                                   depth + 1)
                if found:
                    return found
    return None


def _results(events: Sequence[WriteEvent]) -> dict:
    """Mem0's ``{"results": [...]}`` from typed write events."""
    return {"results": [e.to_dict() for e in events]}


def _turn(i: int, m: Any) -> Turn:
    if not isinstance(m, dict):
        raise TypeError(f"message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
    content = require_text(m.get("content"), f"message {i} content")
    if m.get("name") is not None and not isinstance(m["name"], str):
        raise TypeError(f"message {i} name must be a string, got {type(m['name']).__name__}")
    role = check_role(f"message {i}", m.get("role", "user"))
    turn_id = m.get("id")
    if turn_id is not None and (isinstance(turn_id, bool) or not isinstance(turn_id, (str, int))):
        raise TypeError(f"message {i} id must be a string (or an int), got {type(turn_id).__name__}")
    if isinstance(turn_id, str) and not turn_id.strip():
        raise ValueError(f"message {i} id is blank: give a non-empty turn id, or leave it out for an automatic one")
    if isinstance(turn_id, int) and not -2**63 <= turn_id < 2**63:
        raise ValueError(f"message {i} id {turn_id} is out of range: give a string id")
    return Turn(str(turn_id) if turn_id is not None else "", role, content, m.get("name"),
                metadata=_check_metadata(m.get("metadata")))


#: Deepest metadata accepted (levels of dicts and lists): deeper values could be stored
#: but not read back (JSON encoders stop at ~250 levels).
MAX_METADATA_DEPTH = 32


def _depth(value: Any, level: int = 0) -> int:
    if level > MAX_METADATA_DEPTH:
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level + 1)
    if isinstance(value, (list, tuple)):
        return max((_depth(v, level + 1) for v in value), default=level + 1)
    return level


def _non_string_key(value: Any, level: int = 0) -> Any:
    """The first dict key below ``value`` that is not a string (``None`` if every key is one)."""
    if level > MAX_METADATA_DEPTH + 1:
        return None  # too deep: refused by the depth check
    if isinstance(value, dict):
        for key, child in value.items():
            if not isinstance(key, str):
                return key
            found = _non_string_key(child, level + 1)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for child in value:
            found = _non_string_key(child, level + 1)
            if found is not None:
                return found
    return None


def _check_metadata(metadata: Any) -> dict:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict, got {type(metadata).__name__}")
    bad_key = _non_string_key(metadata)
    if bad_key is not None:  # JSON would turn it into a string, and could merge it with another key
        raise TypeError(f"metadata keys must be strings, got {type(bad_key).__name__} {bad_key!r}")
    try:
        json.dumps(metadata, allow_nan=False)
    except ValueError as exc:  # NaN / Infinity: not JSON, and a JSON reader would see null
        raise ValueError(f"metadata must be JSON: {exc} (NaN and Infinity have no JSON form)") from None
    except (TypeError, RecursionError) as exc:
        raise TypeError(f"metadata must be JSON-serialisable: {exc}") from None
    if _depth(metadata) > MAX_METADATA_DEPTH:
        raise ValueError(f"metadata is nested more than {MAX_METADATA_DEPTH} levels deep: flatten it")
    reserved = sorted({"created_at", "updated_at"} & {str(k) for k in metadata})
    if reserved:
        raise ValueError(f"metadata keys {reserved} are reserved: every memory has them as timestamps (filters "
                         "read those); rename the keys")
    return dict(metadata)
