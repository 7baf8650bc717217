"""The serve path: retrieval, prompt layout, KV readiness, and the vLLM request.

Used by :class:`inferscale.Memory` (``inject`` / ``generate``); kept apart so the
facade stays small and the engine is only imported when something is served.
"""

from __future__ import annotations

import hashlib
import time
from typing import Callable, Iterator, Sequence

from inferscale.facts import FactService
from inferscale.kv.manager import KVManager
from inferscale.serving.prompt import PromptBuilder, PromptLayout
from inferscale.store import FactRecord, Scope
from inferscale.turns import TurnLog
from inferscale.types import Generation, GenerationChunk, Injection, UnknownScopeError, require_text

ItemFn = Callable[[FactRecord, float | None], dict]


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def check_history(history: Sequence[dict] | None) -> tuple[dict, ...]:
    """Validate a conversation history: ``{"role": "user" | "assistant", "content": str}`` dicts.

    Raises:
        TypeError / ValueError: naming the first bad message.
    """
    if history is None:
        return ()
    if isinstance(history, (str, bytes, dict)) or not isinstance(history, Sequence):
        raise TypeError(f"history must be a list of message dicts, got {type(history).__name__}")
    out = []
    for i, m in enumerate(history):
        if not isinstance(m, dict):
            raise TypeError(f"history message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
        if m.get("role") not in ("user", "assistant"):
            raise ValueError(f"history message {i} has role {m.get('role')!r}: use 'user' or 'assistant' (give system "
                             "text as instructions=...)")
        out.append({"role": m["role"], "content": require_text(m.get("content"), f"history message {i} content")})
    return tuple(out)


def check_stop(stop: Sequence[str] | None) -> tuple[str, ...]:
    """Validate stop strings (a list of non-empty strings, or ``None``)."""
    if stop is None:
        return ()
    if isinstance(stop, (str, bytes)) or not isinstance(stop, Sequence) or not all(
            isinstance(x, str) and x for x in stop):
        raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
    return tuple(stop)


class ServePath:
    """Builds and runs requests for one Memory.

    Args:
        facts: retrieval.
        prompts: the prompt scaffold.
        kv: KV naming and encoding.
        turns: the conversation log (a scope with turns but no facts is known).
        engine: returns the vLLM engine (started lazily by the caller).
        item: turns a record and score into a Mem0 result item.
        max_model_len: the engine's context (tokens); longer prompts are refused.
    """

    def __init__(self, facts: FactService, prompts: PromptBuilder, kv: KVManager, turns: TurnLog,
                 engine: Callable[[], object], item: ItemFn, max_model_len: int) -> None:
        self.facts, self.prompts, self.kv, self.turns, self._engine, self._item = facts, prompts, kv, turns, engine, item
        self.max_model_len = max_model_len

    def layout(self, scope: Scope, query: str, k: int, reserve: int = 1, history: Sequence[dict] = (),
               instructions: str | None = None, allow_unknown_scope: bool = False,
               ) -> tuple[PromptLayout, list[tuple[FactRecord, float]], float]:
        """Retrieve the top ``k`` facts and lay out the prompt (best-ranked last).

        Raises:
            UnknownScopeError: the scope has no facts and no turns (unless ``allow_unknown_scope``).
            ValueError: the prompt plus ``reserve`` answer tokens exceeds ``max_model_len``.
        """
        _check_count("k", k)
        history = check_history(history)
        if instructions is not None:
            require_text(instructions, "instructions")
        if (not allow_unknown_scope and self.facts.index.size(scope.key) == 0
                and self.turns.count(scope.key) == 0):
            field = next(iter(scope.as_dict()))
            raise UnknownScopeError(
                f"no memories for {scope.as_dict()}: add some with Memory.add(..., {field}=...) first"
            )
        t0 = time.perf_counter()
        hits = self.facts.search(scope, query, k)
        retrieval = time.perf_counter() - t0
        layout = self.prompts.build(query, [(r.id, r.text) for r, _ in hits[::-1]], history, instructions)
        if len(layout.token_ids) + reserve > self.max_model_len:
            raise ValueError(
                f"the prompt is {len(layout.token_ids)} tokens with k={k} memories; with {reserve} answer tokens it "
                f"exceeds max_model_len={self.max_model_len}: lower k or shorten the question"
            )
        return layout, hits, retrieval

    def inject(self, scope: Scope, query: str, k: int, w: int, reserve: int = 1, history: Sequence[dict] = (),
               instructions: str | None = None, allow_unknown_scope: bool = False) -> Injection:
        """See :meth:`inferscale.Memory.inject`."""
        _check_count("context_window", w)
        layout, hits, retrieval = self.layout(scope, query, k, reserve, history, instructions, allow_unknown_scope)
        spans = [self.kv.preamble_span(), *self.kv.fact_spans(scope.key, [r for r, _ in hits[::-1]], w)]
        self.kv.ensure(spans)
        segments = [[s.key, seg.start, len(seg.token_ids)] for s, seg in zip(spans, layout.segments)]
        return Injection(
            prompt_token_ids=layout.token_ids,
            kv_transfer_params={"inferscale": {"memory_end": layout.memory_end, "segments": segments}},
            cache_salt=hashlib.sha256("|".join(s.key for s in spans).encode()).hexdigest()[:32],
            memories=[self._item(r, s) for r, s in hits],
            memory_tokens=layout.memory_end,
            retrieval_s=retrieval,
        )

    def generate(self, scope: Scope, query: str, **kwargs) -> Generation:
        """See :meth:`inferscale.Memory.generate` (consumes :meth:`stream`)."""
        for chunk in self.stream(scope, query, **kwargs):
            if chunk.generation is not None:
                return chunk.generation
        raise RuntimeError("the stream ended without a generation")

    def stream(self, scope: Scope, query: str, *, k: int, w: int, mode: str, max_tokens: int, temperature: float,
               logprobs: int | None = None, stop: Sequence[str] | None = None, history: Sequence[dict] = (),
               instructions: str | None = None, allow_unknown_scope: bool = False) -> Iterator[GenerationChunk]:
        """See :meth:`inferscale.Memory.stream`: retrieval, checks and KV readiness happen in
        this call; the returned iterator runs the request."""
        if mode not in ("inject", "text"):
            raise ValueError(f"mode must be 'inject' or 'text', got {mode!r}")
        _check_count("max_tokens", max_tokens)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= 20):
            raise ValueError(f"logprobs must be None or an integer in 0..20, got {logprobs!r}")
        stop = check_stop(stop)
        prompt_args = dict(reserve=max(1, max_tokens), history=history, instructions=instructions,
                           allow_unknown_scope=allow_unknown_scope)
        if mode == "inject":
            inj = self.inject(scope, query, k, w, **prompt_args)
            prompt, params, salt, memories, retrieval = (
                inj.prompt_token_ids, inj.kv_transfer_params, inj.cache_salt, inj.memories, inj.retrieval_s
            )
        else:
            layout, hits, retrieval = self.layout(scope, query, k, **prompt_args)
            prompt, params, salt = layout.token_ids, None, None
            memories = [self._item(r, s) for r, s in hits]
        request = dict(kv_transfer_params=params, cache_salt=salt, max_tokens=max_tokens, temperature=temperature,
                       stop=stop, logprobs=logprobs)
        return self._run(prompt, request, mode, memories, retrieval)

    def _run(self, prompt: Sequence[int], request: dict, mode: str, memories: list[dict], retrieval: float
             ) -> Iterator[GenerationChunk]:
        emitted = ""
        for chunk in self._engine().stream(prompt, **request):
            # the answer is the stripped text: hold back leading and trailing whitespace
            visible = chunk.text.strip()
            delta = visible[len(emitted):] if visible.startswith(emitted) else ""
            emitted += delta
            out = chunk.output
            if out is None:
                if delta:
                    yield GenerationChunk(delta)
                continue
            yield GenerationChunk(delta, Generation(
                text=visible, mode=mode, ttft_s=out.ttft_s, latency_s=out.latency_s, retrieval_s=retrieval,
                num_prompt_tokens=out.num_prompt_tokens, num_injected_tokens=out.num_injected_tokens,
                num_prefilled_tokens=out.num_prompt_tokens - out.num_cached_tokens, memories=memories,
                first_logprobs=out.first_logprobs, num_generated_tokens=len(out.token_ids),
            ))
