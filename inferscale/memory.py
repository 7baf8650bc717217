"""``Memory``: the Mem0-style facade (add / search / get_all / inject / generate).

Write path (:meth:`Memory.add`, :meth:`Memory.add_facts`): raw turns go to the scope's
turn log; facts are embedded, written to Chroma (the system of record) first, then to
the device index, then their KV is encoded at the default context window and put in
the KV pool. Serve path (:meth:`Memory.inject`, :meth:`Memory.generate`): embed the
query, exact top-k in the scope's partition, build the prompt, make sure every
retrieved fact's KV is in the pool, and hand vLLM the token ids plus the
``kv_transfer_params`` its :class:`~inferscale.serving.connector.InferScaleConnector` reads.
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, Sequence

from inferscale.config import MemoryConfig
from inferscale.embedding import Embedder
from inferscale.index import VectorIndex
from inferscale.kv.encoder import best_device
from inferscale.kv.manager import KVManager
from inferscale.kv.pool import KVPool
from inferscale.models import model_fingerprint, resolve_llm
from inferscale.serving.prompt import PromptBuilder, PromptLayout
from inferscale.store import FactRecord, FactStore, Scope
from inferscale.turns import Turn, TurnLog
from inferscale.types import FactInput, Generation, Injection, UnknownScopeError, require_text


def _text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Memory:
    """Persistent per-user memory served to vLLM as precomputed KV.

    Args:
        config: a :class:`~inferscale.config.MemoryConfig` (default: defaults plus
            ``INFERSCALE_*`` environment variables).
        engine: an existing :class:`~inferscale.serving.engine.Engine` whose connector reads
            this data dir's KV pool (default: one is started on first use).
        **overrides: fields of the config, e.g. ``Memory(data_dir="./mem", dtype="float32")``.

    Raises:
        inferscale.models.ModelNotFoundError: the LLM or embedder cannot be found.
        inferscale.store.StoreError: the data dir cannot be used.

    Example:
        >>> m = Memory(data_dir="./mem")
        >>> m.add("I am allergic to peanuts.", user_id="alice")
        >>> m.generate("What should I avoid eating?", user_id="alice").text
    """

    def __init__(self, config: MemoryConfig | None = None, *, engine=None, **overrides: Any) -> None:
        base = config or MemoryConfig()
        self.config = MemoryConfig(**{**base.model_dump(exclude_unset=True), **overrides}) if overrides else base
        data = self.config.data_dir
        self.device = best_device()
        self.model_path = resolve_llm(self.config.llm)
        self.store = FactStore(data / "chroma")
        self.turns = TurnLog(data / "turns.sqlite")
        self.embedder = Embedder(self.config.embedder, self.device)
        ids, scopes, emb = self.store.load_all()
        self.index = VectorIndex.from_rows(self.device, ids, scopes, emb)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        self.prompts = PromptBuilder(self.tokenizer, self.config.system_prompt)
        self.kv_dir = data / "kv"
        self.pool = KVPool.shared(self.kv_dir, self.device, self.config.device_kv_budget_bytes)
        self.kv = KVManager(
            self.model_path,
            model_fingerprint(self.model_path),
            self.config.resolved_dtype,
            self.prompts,
            self.pool,
            self.turns,
            self.config.encode_batch_tokens,
        )
        if engine is not None and Path(engine.kv_dir).resolve() != self.kv_dir.resolve():
            raise ValueError(f"the given engine serves KV from {engine.kv_dir}, not this memory's {self.kv_dir}")
        self._engine = engine
        self._write_lock = threading.RLock()

    @classmethod
    def from_config(cls, config: dict) -> "Memory":
        """Mem0-style constructor from a plain dict of :class:`MemoryConfig` fields."""
        return cls(MemoryConfig(**config))

    # ------------------------------------------------------------------ writes

    def log_turns(
        self, messages: Sequence[dict], *, user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None
    ) -> list[Turn]:
        """Append raw turns to the scope's log without storing facts.

        Args:
            messages: dicts with ``content`` and optional ``role`` (default ``"user"``),
                ``name``, ``id`` (turn id, unique in the scope) and ``metadata``.

        Returns:
            The logged :class:`~inferscale.turns.Turn` s.

        Raises:
            ValueError / TypeError: a message is malformed, or an id is reused (nothing is logged).
        """
        scope = Scope.of(user_id, agent_id, run_id)
        turns = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise TypeError(f"message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
            turns.append(
                Turn(
                    str(m["id"]) if m.get("id") is not None else "",
                    str(m.get("role", "user")),
                    require_text(m.get("content"), f"message {i} content"),
                    m.get("name"),
                    metadata=dict(m.get("metadata") or {}),
                )
            )
        return self.turns.append(scope.key, turns)

    def add(
        self,
        messages: str | dict | Sequence[dict],
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        metadata: dict | None = None,
        infer: bool = False,
    ) -> dict:
        """Remember ``messages`` (Mem0's ``add``).

        The messages are appended to the scope's turn log; with ``infer=False`` each
        message's content is stored as a fact whose provenance is its own turn.

        Args:
            messages: a string, a message dict (``{"role", "content"}``) or a list of them.
            user_id / agent_id / run_id: the scope; at least one is required.
            metadata: attached to every stored fact.
            infer: LLM fact extraction; not available yet (``infer=False`` stores as given).

        Returns:
            ``{"results": [{"id", "memory", "event"}]}`` with ``event`` ``"ADD"``, or
            ``"NOOP"`` for a fact already stored in the scope.

        Raises:
            ValueError / TypeError: empty or non-string text, no scope (nothing is written).
            NotImplementedError: ``infer=True``.
        """
        if infer:
            raise NotImplementedError("infer=True (LLM fact extraction) is not available yet; pass infer=False")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        elif isinstance(messages, dict):
            messages = [messages]
        if not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages is empty: give a string, a message dict or a list of message dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise TypeError(f"message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
            require_text(m.get("content"), f"message {i} content")
        Scope.of(user_id, agent_id, run_id)
        with self._write_lock:
            turns = self.log_turns(messages, user_id=user_id, agent_id=agent_id, run_id=run_id)
            facts = [FactInput(t.content, (t.turn_id,), dict(metadata or {})) for t in turns]
            return self.add_facts(facts, user_id=user_id, agent_id=agent_id, run_id=run_id)

    def add_facts(
        self,
        facts: Sequence[FactInput | str],
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        encode_kv: bool = True,
    ) -> dict:
        """Store facts with provenance (LoCoMo observations, extracted facts).

        Args:
            facts: :class:`FactInput` s (or plain strings, without provenance).
            encode_kv: encode each fact's KV at the default context window now
                (otherwise on first use).

        Returns:
            ``{"results": [{"id", "memory", "event"}]}`` as :meth:`add`.

        Raises:
            ValueError / TypeError: empty text, or a source turn id not in the scope's log.
        """
        scope = Scope.of(user_id, agent_id, run_id)
        inputs = [FactInput(f) if isinstance(f, str) else f for f in facts]
        for i, f in enumerate(inputs):
            if not isinstance(f, FactInput):
                raise TypeError(f"fact {i} must be a FactInput or a string, got {type(f).__name__}")
            require_text(f.text, f"fact {i} text")
        wanted = sorted({t for f in inputs for t in f.source_turn_ids})
        known = self.turns.get(scope.key, wanted)
        if len(known) != len(wanted):
            missing = [t for t in wanted if t not in known]
            raise ValueError(f"source turn ids {missing[:5]} are not in this scope's log: log them with log_turns first")
        with self._write_lock:
            existing = self.store.find_hashes(scope, [_text_hash(f.text) for f in inputs])
            results, records, seen = [], [], dict(existing)
            now = datetime.now(timezone.utc).isoformat()
            for f in inputs:
                h = _text_hash(f.text)
                if h in seen:
                    results.append({"id": seen[h], "memory": f.text, "event": "NOOP"})
                    continue
                rec = FactRecord(uuid.uuid4().hex, f.text, h, scope, tuple(f.source_turn_ids), dict(f.metadata), now)
                seen[h] = rec.id
                records.append(rec)
                results.append({"id": rec.id, "memory": f.text, "event": "ADD"})
            if records:
                emb = self.embedder.encode([r.text for r in records])
                self.store.add(records, emb.numpy())  # the system of record first
                self.index.add(scope.key, [r.id for r in records], emb)
        if records and encode_kv:
            self.kv.ensure([self.kv.preamble_span(), *self.kv.fact_spans(scope.key, records, self.config.context_window)])
        return {"results": results}

    # ------------------------------------------------------------------ reads

    @staticmethod
    def _item(rec: FactRecord, score: float | None = None) -> dict:
        item = {
            "id": rec.id,
            "memory": rec.text,
            "hash": rec.hash,
            "metadata": rec.metadata,
            "source_turn_ids": list(rec.source_turn_ids),
            "created_at": rec.created_at,
            **rec.scope.as_dict(),
        }
        if score is not None:
            item["score"] = score
        return item

    def _search(self, query: str, scope: Scope, limit: int) -> list[tuple[FactRecord, float]]:
        require_text(query, "query")
        if not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit must be a non-negative integer, got {limit!r}")
        if limit == 0 or self.index.size(scope.key) == 0:
            return []
        hits = self.index.search(scope.key, self.embedder.encode([query])[0], limit)
        records = {r.id: r for r in self.store.get(scope, [i for i, _ in hits])}
        return [(records[i], s) for i, s in hits if i in records]

    def search(
        self, query: str, *, user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None,
        limit: int = 100,
    ) -> dict:
        """Facts of the scope most similar to ``query`` (exact cosine top-k).

        Returns:
            ``{"results": [{"id", "memory", "score", "metadata", ...}]}``, best first;
            empty for a scope with no facts.
        """
        scope = Scope.of(user_id, agent_id, run_id)
        return {"results": [self._item(r, s) for r, s in self._search(query, scope, limit)]}

    def get_all(
        self, *, user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None, limit: int = 100
    ) -> dict:
        """Every fact of the scope, oldest first, at most ``limit``: ``{"results": [...]}``."""
        scope = Scope.of(user_id, agent_id, run_id)
        return {"results": [self._item(r) for r in self.store.list(scope)[:limit]]}

    # ------------------------------------------------------------------ serving

    def _layout(self, query: str, scope: Scope, k: int | None) -> tuple[PromptLayout, list[tuple[FactRecord, float]], float]:
        if self.index.size(scope.key) == 0 and self.turns.count(scope.key) == 0:
            raise UnknownScopeError(
                f"no memories for {scope.as_dict()}: add some with Memory.add(..., {next(iter(scope.as_dict()))}=...) first"
            )
        t0 = time.perf_counter()
        hits = self._search(query, scope, self.config.top_k if k is None else k)
        retrieval = time.perf_counter() - t0
        ranked = hits[::-1]  # best-ranked last, next to the question
        return self.prompts.build(query, [(r.id, r.text) for r, _ in ranked]), hits, retrieval

    def inject(
        self, query: str, *, user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None,
        k: int | None = None, context_window: int | None = None,
    ) -> Injection:
        """Retrieve the scope's top-``k`` facts and prepare one vLLM request that injects their KV.

        Encodes (and stores) any missing KV first, so the request never falls back.

        Args:
            k: facts to retrieve (default ``config.top_k``).
            context_window: w, in turns (default ``config.context_window``).

        Raises:
            UnknownScopeError: the scope has no memories and no turns.
            ValueError: empty query, negative k or w.
        """
        scope = Scope.of(user_id, agent_id, run_id)
        w = self.config.context_window if context_window is None else context_window
        if not isinstance(w, int) or w < 0:
            raise ValueError(f"context_window must be a non-negative integer, got {w!r}")
        layout, hits, retrieval = self._layout(query, scope, k)
        ranked = [r for r, _ in hits[::-1]]
        spans = [self.kv.preamble_span(), *self.kv.fact_spans(scope.key, ranked, w)]
        self.kv.ensure(spans)
        segments = [[s.key, seg.start, len(seg.token_ids)] for s, seg in zip(spans, layout.segments)]
        salt = hashlib.sha256("|".join(s.key for s in spans).encode()).hexdigest()[:32]
        return Injection(
            prompt_token_ids=layout.token_ids,
            kv_transfer_params={"inferscale": {"memory_end": layout.memory_end, "segments": segments}},
            cache_salt=salt,
            memories=[self._item(r, s) for r, s in hits],
            memory_tokens=layout.memory_end,
            retrieval_s=retrieval,
        )

    @property
    def engine(self):
        """The in-process vLLM engine with InferScale's connector (started on first use)."""
        if self._engine is None:
            from inferscale.serving.engine import Engine

            self._engine = Engine(
                self.model_path,
                dtype=self.config.resolved_dtype,
                kv_dir=self.kv_dir,
                max_model_len=self.config.max_model_len,
                kv_cache_memory_bytes=self.config.kv_cache_memory_bytes,
                device_budget_bytes=self.config.device_kv_budget_bytes,
            )
        return self._engine

    def generate(
        self, query: str, *, user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None,
        k: int | None = None, context_window: int | None = None, mode: Literal["inject", "text"] = "inject",
        max_tokens: int = 64, temperature: float = 0.0, logprobs: int | None = None,
    ) -> Generation:
        """Answer ``query`` with the scope's memory.

        Args:
            mode: ``"inject"`` supplies the memory block as precomputed KV; ``"text"``
                prefills the same tokens (Mem0-style prompt injection).
            max_tokens: answer budget (tokens). temperature: 0 is greedy.
            logprobs: also return the top-N logprobs of the first answer token.

        Raises:
            UnknownScopeError, ValueError: as :meth:`inject`; ``ValueError`` for an unknown mode.
        """
        if mode not in ("inject", "text"):
            raise ValueError(f"mode must be 'inject' or 'text', got {mode!r}")
        if mode == "inject":
            inj = self.inject(query, user_id=user_id, agent_id=agent_id, run_id=run_id, k=k, context_window=context_window)
            prompt, params, salt = inj.prompt_token_ids, inj.kv_transfer_params, inj.cache_salt
            memories, retrieval = inj.memories, inj.retrieval_s
        else:
            layout, hits, retrieval = self._layout(query, Scope.of(user_id, agent_id, run_id), k)
            prompt, params, salt = layout.token_ids, None, None
            memories = [self._item(r, s) for r, s in hits]
        out = self.engine.generate(
            prompt,
            kv_transfer_params=params,
            cache_salt=salt,
            max_tokens=max_tokens,
            temperature=temperature,
            logprobs=logprobs,
        )
        return Generation(
            text=out.text.strip(),
            mode=mode,
            ttft_s=out.ttft_s,
            latency_s=out.latency_s,
            retrieval_s=retrieval,
            num_prompt_tokens=out.num_prompt_tokens,
            num_injected_tokens=out.num_injected_tokens,
            num_prefilled_tokens=out.num_prompt_tokens - out.num_cached_tokens,
            memories=memories,
            first_logprobs=out.first_logprobs,
        )
