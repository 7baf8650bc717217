"""Keeps every fact's KV in the pool for the settings it is served with.

Owns the naming of KV (:func:`inferscale.kv.pool.kv_key` over the model fingerprint,
dtype, w, and the exact context and fact tokens), the building of Context-Window
Encoding contexts from the turn log, and the lazy encoder.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from inferscale.kv.encoder import EncodeItem, KVEncoder
from inferscale.kv.pool import KVPool, kv_key
from inferscale.prompt import PromptBuilder
from inferscale.store import FactRecord
from inferscale.turns import TurnLog


def _digest(ids: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class FactSpan:
    """A fact's KV request: where its KV lives and what to encode if it is missing."""

    key: str
    item: EncodeItem


class KVManager:
    """Names, builds and looks up fact KV.

    Args:
        model_path: the served model's folder.
        fingerprint: :func:`inferscale.models.model_fingerprint` of it.
        dtype: KV dtype name.
        prompts: the prompt builder (its preamble starts every context).
        pool: the KV pool.
        turns: the conversation log.
        batch_tokens: encoder batch budget (tokens).
        max_tokens: longest encoding (context plus fact, tokens); the oldest window turns
            are dropped to fit.
    """

    def __init__(
        self,
        model_path: Path,
        fingerprint: str,
        dtype: str,
        prompts: PromptBuilder,
        pool: KVPool,
        turns: TurnLog,
        batch_tokens: int,
        max_tokens: int = 8192,
    ) -> None:
        self.model_path = model_path
        self.fingerprint = fingerprint
        self.dtype = dtype
        self.prompts = prompts
        self.pool = pool
        self.turns = turns
        self.batch_tokens = batch_tokens
        self.max_tokens = max_tokens
        self._encoder: KVEncoder | None = None

    @property
    def encoder(self) -> KVEncoder:
        """The transformers model that encodes KV (loaded on first use)."""
        if self._encoder is None:
            self._encoder = KVEncoder(self.model_path, self.dtype, batch_tokens=self.batch_tokens)
        return self._encoder

    def fact_tokens(self, text: str) -> int:
        """Tokens of the fact's memory line (what its KV covers)."""
        return len(self.prompts.fact_line_ids(text))

    def invalidate(self, fact_id: str) -> None:
        """Drop every stored KV variant of a fact (on update and delete)."""
        self.pool.invalidate_owner(fact_id)

    def clear(self) -> None:
        """Drop all stored KV."""
        self.pool.clear()

    def preamble_span(self) -> FactSpan:
        ids = self.prompts.preamble_ids
        key = kv_key("_preamble", fp=self.fingerprint, dtype=self.dtype, ids=_digest(ids))
        return FactSpan(key, EncodeItem((), ids))

    def fact_spans(self, scope_key: str, facts: Sequence[FactRecord], w: int) -> list[FactSpan]:
        """The KV request of each fact at context window ``w`` (turns)."""
        spans = []
        sources = self.turns.get(scope_key, sorted({t for f in facts for t in f.source_turn_ids}))
        for fact in facts:
            seqs = [sources[t].seq for t in fact.source_turn_ids if t in sources]
            window = self.turns.window(scope_key, min(seqs), w) if seqs and w > 0 else []
            span = self.prompts.fact_line_ids(fact.text)
            lines = [self.prompts.fact_line_ids(turn.render()) for turn in window]
            budget = self.max_tokens - len(self.prompts.preamble_ids) - len(span)
            while lines and sum(map(len, lines)) > budget:
                lines.pop(0)  # drop the oldest turns until the encoding fits the context
            context = list(self.prompts.preamble_ids)
            for line in lines:
                context.extend(line)
            key = kv_key(
                fact.id, fp=self.fingerprint, dtype=self.dtype, w=w, ctx=_digest(context), span=_digest(span)
            )
            spans.append(FactSpan(key, EncodeItem(tuple(context), span)))
        return spans

    def ensure(self, spans: Sequence[FactSpan]) -> int:
        """Encode and store every span whose KV is not in the pool; returns how many were encoded."""
        missing = {s.key: s for s in spans if not self.pool.contains(s.key)}
        if not missing:
            return 0
        todo = list(missing.values())
        for span, kv in zip(todo, self.encoder.encode([s.item for s in todo])):
            self.pool.put(span.key, kv)
        return len(todo)
