"""The request builder: retrieval, prompt layout, KV readiness, the injection plan, and running the request.

:meth:`RequestBuilder.prepare` turns a query into a :class:`PreparedRequest` (token ids, the
:class:`~inferscale.kv.injection.InjectionPlan` in inject mode, the retrieved facts);
:func:`run` sends it to an engine and yields the answer as it grows. Both are typed:
Mem0's result dicts are made by the facade (:class:`inferscale.Memory`) only.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Protocol, Sequence

from inferscale.checks import check_bool
from inferscale.facts.writes import FactService
from inferscale.kv.disk import DiskFullError
from inferscale.runtime.outages import OUTAGES
from inferscale.kv.capture import CaptureRequest
from inferscale.kv.injection import InjectionPlan, cache_salt
from inferscale.kv.manager import KVManager
from inferscale.generation.options import GenerationOptions
from inferscale.generation.prompt import PREAMBLE_OWNER, PromptBuilder, Segment
from inferscale.store.records import FactRecord, Scope
from inferscale.generation.tools import call_schema, parse_tool_calls, render_tool_calls, tool_instructions
from inferscale.store.turns import TurnLog
from inferscale.types import Generation, GenerationChunk, UnknownScopeError, require_text


class EngineLike(Protocol):
    """What :func:`run` needs of an engine (:class:`inferscale.serving.engine.Engine`)."""

    def stream(self, prompt_token_ids: Sequence[int], **options) -> Iterator: ...

    def check_json_schema(self, schema: dict) -> None: ...


#: What ``kv_sources`` says of a memory in inject mode: its KV was found in this process's
#: ``"device"`` or ``"host"`` tier, on ``"disk"`` (the tier vLLM's connector reads; it may
#: hold the KV in its own device tier) or only in the shared ``"redis"`` tier (the connector
#: reads it from there), was ``"quantized now"`` from model-dtype KV, was
#: ``"encoded now"`` (``wait_for_kv``), or the memory came as text: ``"text: not encoded yet"``,
#: ``"text: evicted"`` (its KV was evicted past a tier budget; captured by this request, or
#: queued to be encoded again where the connector is not seen to capture) or
#: ``"text: Redis unavailable"`` (in no local tier, and the shared Redis tier did not answer).
#: A tier followed by ``" (captured)"`` names KV an earlier request captured when it served
#: the memory as text (``capture_kv``), not KV the encoder made.
KV_SOURCES = ("device", "host", "disk", "redis", "quantized now", "encoded now", "text: not encoded yet", "text: evicted",
              "text: Redis unavailable", "text: KV disk full", "device (captured)", "host (captured)",
              "disk (captured)", "redis (captured)")


@dataclass(frozen=True)
class PreparedRequest:
    """One request, ready for the engine.

    Attributes:
        prompt_token_ids: the whole prompt (tokens).
        plan: what the connector injects (``None`` in text mode).
        hits: the retrieved facts and their scores, best first.
        retrieval_s: query embedding plus search (seconds).
        memory_tokens: tokens supplied as KV in inject mode (the preamble and the injected
            fact lines); in text mode, the preamble and every fact line.
        options: the generation's options, with k and w resolved.
        kv_memory_ids: facts whose KV the plan injects (in inject mode).
        text_memory_ids: facts placed as text, to be prefilled (all of them in text mode;
            in inject mode those whose KV is not encoded yet).
        json_schema: the JSON Schema the answer is decoded under (``options.json_schema``,
            or a forced tool call's), ``None`` for free text.
        kv_sources: in inject mode, per fact id, where its KV was when the request was
            planned (:data:`KV_SOURCES`).
        scope_key: the scope whose memory the prompt carries (its prefix-cache salt's).
    """

    prompt_token_ids: tuple[int, ...]
    plan: InjectionPlan | None
    hits: tuple[tuple[FactRecord, float], ...]
    retrieval_s: float
    memory_tokens: int
    options: GenerationOptions
    kv_memory_ids: tuple[str, ...] = ()
    text_memory_ids: tuple[str, ...] = ()
    json_schema: dict | None = None
    kv_sources: dict[str, str] = field(default_factory=dict)
    scope_key: str = ""

    @property
    def kv_transfer_params(self) -> dict | None:
        return None if self.plan is None else self.plan.to_params()

    @property
    def cache_salt(self) -> str:
        """The scope's prefix-cache salt (:func:`inferscale.kv.injection.cache_salt`), in either mode."""
        return cache_salt(self.scope_key, self.plan)


def check_history(history: Sequence[dict] | None, what: str = "history") -> tuple[dict, ...]:
    """Validate conversation messages: ``{"role": "user" | "assistant" | "tool", "content": str}``
    dicts; an assistant message may instead (or also) carry ``"tool_calls"`` (``{"name",
    "arguments"}`` dicts, OpenAI's ``{"function": {...}}`` form too), rendered into its text
    as :func:`inferscale.generation.tools.render_tool_calls` writes them.

    Returns:
        The messages as ``{"role", "content"}`` dicts, ready for the chat template.

    Raises:
        TypeError / ValueError: naming the first bad message.
    """
    if history is None:
        return ()
    if isinstance(history, (str, bytes, dict)) or not isinstance(history, Sequence):
        raise TypeError(f"{what} must be a list of message dicts, got {type(history).__name__}")
    out = []
    for i, m in enumerate(history):
        if not isinstance(m, dict):
            raise TypeError(f"{what} message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in ("user", "assistant", "tool"):
            raise ValueError(f"{what} message {i} has role {role!r}: use 'user', 'assistant' or 'tool' (give system "
                             "text as instructions=...)")
        if m.get("tool_calls") is not None and role != "assistant":
            raise ValueError(f"{what} message {i} ({role}) has tool_calls: only assistant messages call tools")
        calls = _tool_calls(m.get("tool_calls"), f"{what} message {i}") if role == "assistant" else []
        content = m.get("content")
        if role == "user" or not (content is None or content == ""):
            content = require_text(content, f"{what} message {i} content")
        elif content is None and not calls:
            raise TypeError(f"{what} message {i} ({role}) has no content: give a string ('' for an empty tool result)")
        # an empty tool result or assistant turn is valid (a tool may return nothing)
        content = "\n".join(part for part in (content, render_tool_calls(calls)) if part)
        out.append({"role": role, "content": content})
    return tuple(out)


def _tool_calls(calls: object, what: str) -> list[dict]:
    if calls is None:
        return []
    if not isinstance(calls, (list, tuple)):
        raise TypeError(f"{what}: tool_calls must be a list of {{'name', 'arguments'}} dicts, got {type(calls).__name__}")
    out = []
    for j, c in enumerate(calls):
        c = c.get("function", c) if isinstance(c, dict) else c
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            raise TypeError(f"{what}: tool_calls[{j}] must be a dict with a 'name' and 'arguments', got {c!r:.200}")
        args = c.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{what}: tool_calls[{j}].arguments is not JSON: {exc}") from None
        if not isinstance(args, dict):
            raise TypeError(f"{what}: tool_calls[{j}].arguments must be a JSON object, got {type(args).__name__}")
        try:
            json.dumps(args)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{what}: tool_calls[{j}].arguments is not JSON ({exc}): give plain JSON values") from None
        out.append({"name": c["name"], "arguments": args})
    return out


class RequestBuilder:
    """Builds requests for one memory store.

    Args:
        facts: retrieval. prompts: the prompt scaffold. kv: KV naming and encoding.
        turns: the conversation log (a scope with turns but no facts is known).
        max_model_len: the engine's context (tokens); longer prompts are refused.
    """

    def __init__(self, facts: FactService, prompts: PromptBuilder, kv: KVManager, turns: TurnLog,
                 max_model_len: int) -> None:
        self.facts, self.prompts, self.kv, self.turns = facts, prompts, kv, turns
        self.max_model_len = max_model_len

    def check_prompt_chars(self, texts: Sequence[str]) -> None:
        """Refuse, before tokenizing, texts with more characters together than a prompt of
        ``max_model_len`` tokens can hold (:attr:`PromptBuilder.max_token_chars` a token).

        Raises:
            ValueError: naming the length, the limit and the fix.
        """
        chars, most = sum(map(len, texts)), self.max_model_len * self.prompts.max_token_chars
        if chars > most:
            raise ValueError(f"the prompt's text is {chars} characters, more than a context of max_model_len="
                             f"{self.max_model_len} tokens can hold (at most {most}): send less (or raise max_model_len)")

    def prepare(self, scope: Scope, query: str, options: GenerationOptions, *, history: Sequence[dict] | None = None,
                instructions: str | None = None, allow_unknown_scope: bool = False,
                followup: Sequence[dict] | None = None) -> PreparedRequest:
        """Retrieve the top ``options.k`` facts, lay out the prompt and, in inject mode, plan the injection.

        Text mode: the facts best-ranked last (``options.memory_order``). Inject mode never
        waits for encoding unless ``options.wait_for_kv``: the facts whose KV is in the pool
        come first (injected, best-ranked last among them), then those without KV as text
        (prefilled, likewise; ``best_first`` reverses both),
        then the question; the missing KV is queued for the background encoder, so a
        later request injects it.

        Tools (``options.tools``) are described after ``instructions`` in the system turn,
        after the memory block, so the memory block and its KV do not change; a forced tool
        call or ``options.json_schema`` becomes the request's ``json_schema``.

        Args:
            options: with ``k`` and ``context_window`` resolved (not ``None``).
            followup: messages after the question (an assistant's tool calls, then the tool
                results), as :func:`check_history` takes them.

        Raises:
            UnknownScopeError: the scope has no facts and no turns (unless ``allow_unknown_scope``).
            ValueError: the prompt plus ``max_tokens`` exceeds ``max_model_len``; a bad history.
        """
        require_text(query, "query")
        history = check_history(history)
        followup = check_history(followup, "followup")
        check_bool("allow_unknown_scope", allow_unknown_scope)
        if instructions is not None:
            require_text(instructions, "instructions")
        self.check_prompt_chars([query, instructions or "", *(m["content"] for m in (*history, *followup)
                                                              if isinstance(m.get("content"), str))])
        if options.offered_tools():
            tools = tool_instructions(options.offered_tools())
            instructions = f"{instructions}\n\n{tools}" if instructions else tools
        forced = options.forced_tool()
        json_schema = call_schema(options.tools, forced) if forced else options.json_schema
        sel = self._select(scope, query, options, allow_unknown_scope)
        layout = self.prompts.build(query, [(r.id, r.text) for r in sel.ranked], history, instructions, followup)
        if len(layout.token_ids) + options.max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt is {len(layout.token_ids)} tokens with k={options.k} memories; with "
                f"{options.max_tokens} answer tokens it exceeds max_model_len={self.max_model_len}: lower k or "
                "shorten the question"
            )
        plan = sel.plan(layout.segments) if options.mode == "inject" else None
        memory_tokens = plan.memory_end if plan is not None else layout.memory_end
        return PreparedRequest(layout.token_ids, plan, sel.hits, sel.retrieval_s, memory_tokens, options,
                               sel.kv_ids, sel.text_ids, json_schema, sel.kv_sources, scope.key)

    def prepare_memory_block(self, scope: Scope, query: str, options: GenerationOptions, *,
                             instructions: str | None = None) -> "MemoryBlock":
        """The memory block of a chat request whose template is applied by someone else (vLLM's
        chat endpoint): the system turn's text and, in inject mode, the plan that claims its
        preamble and fact lines. Retrieval, ordering and readiness as :meth:`prepare`; an
        unknown scope gets an empty block (a new user's first request).

        The plan assumes the rendered prompt starts with the preamble and fact lines as
        :class:`~inferscale.generation.prompt.PromptBuilder` tokenizes them; the connector verifies each
        segment's tokens against the prompt and prefills whatever does not match.

        Args:
            instructions: the client's own system text, placed after the memory lines.

        Raises:
            ValueError: empty query or instructions; the memory block alone leaves under 16
                tokens of the context (before any KV is encoded).
        """
        if instructions is not None:
            require_text(instructions, "instructions")
        sel = self._select(scope, query, options, allow_unknown_scope=True, max_block_tokens=self.max_model_len - 16)
        system = self.prompts.system_text([r.text for r in sel.ranked], instructions)
        segments = self.prompts.memory_segments([(r.id, r.text) for r in sel.ranked])
        plan = sel.plan(segments) if options.mode == "inject" else None
        memory_tokens = plan.memory_end if plan is not None else segments[-1].end
        return MemoryBlock(system, plan, sel.hits, sel.retrieval_s, memory_tokens, sel.kv_ids, sel.text_ids,
                           sel.kv_sources, scope.key)

    def _select(self, scope: Scope, query: str, options: GenerationOptions, allow_unknown_scope: bool,
                max_block_tokens: int | None = None) -> "_Selection":
        if not allow_unknown_scope and not self.facts.has_facts(scope) and self.turns.count(scope.key) == 0:
            field = next(iter(scope.as_dict()))
            raise UnknownScopeError(
                f"no memories for {scope.as_dict()}: add some with Memory.add(..., {field}=...) first"
            )
        t0 = time.perf_counter()
        hits = self.facts.search(scope, query[:self.facts.max_query_chars], options.k)  # the embedder reads less
        retrieval = time.perf_counter() - t0
        ranked = [r for r, _ in (hits if options.memory_order == "best_first" else hits[::-1])]
        if max_block_tokens is not None:
            block = len(self.prompts.preamble_ids) + sum(len(self.prompts.fact_line_ids(r.text)) for r in ranked)
            if block > max_block_tokens:
                raise ValueError(f"the memory block of {len(ranked)} memories is {block} tokens, which leaves no room "
                                 f"in the context of {self.max_model_len} tokens: lower memory.k")
        if options.mode != "inject":
            return _Selection(ranked, {}, tuple(hits), retrieval, (), tuple(r.id for r in ranked))
        w = options.context_window
        preamble = self.kv.preamble_span()
        keys = self.kv.fact_keys(scope.key, ranked, w)
        pool = self.kv.pool
        found = dict(zip((r.id for r in ranked), pool.tiers(keys)))  # one Redis round trip at most
        ready = [found[r.id] is not None for r in ranked]
        missing = [r for r, ok in zip(ranked, ready) if not ok]
        if missing and self.kv.storage != "auto":  # KV kept in the model's dtype is quantized now, not re-encoded
            self.kv.quantize_stored(self.kv.fact_spans(scope.key, missing, w))
            ready = [self.kv.stored(k) for k in keys]
            missing = [r for r, ok in zip(ranked, ready) if not ok]
        captured: set[str] = set()
        if missing and self.kv.capture:  # KV a request captured when the memory came as text
            ckeys = self.kv.captured_keys(missing)
            for r, key, tier in zip(missing, ckeys, pool.tiers(ckeys)):
                if tier is not None:
                    captured.add(r.id)
                    found[r.id] = tier
                    keys[ranked.index(r)] = key
            if captured:
                ready = [ok or r.id in captured for r, ok in zip(ranked, ready)]
                missing = [r for r in missing if r.id not in captured]
        redis_down = pool.remote is not None and not pool.remote.available
        sources = {r.id: f"{found[r.id]} (captured)" if r.id in captured else
                   found[r.id] or ("quantized now" if ok else "text: evicted" if pool.was_evicted(k) else
                                   "text: Redis unavailable" if redis_down else
                                   "text: KV disk full" if pool.disk_full else "text: not encoded yet")
                   for r, k, ok in zip(ranked, keys, ready)}
        try:  # first: without the preamble's KV nothing can be injected, and facts' KV would be stored in vain
            self.kv.ensure([preamble])
        except DiskFullError as exc:  # no room for it: all text, the missing facts queued for when there is
            OUTAGES.failed("kv_disk", exc)  # said once per outage, as the background encoder says it
            if missing:
                self.kv.schedule(scope.key, missing, w)
            pool.count_served(None for _ in ranked)
            ids = tuple(r.id for r in ranked)
            return _Selection(ranked, {}, tuple(hits), retrieval, (), ids, {i: "text: KV disk full" for i in ids})
        if options.wait_for_kv and missing:
            try:
                self.kv.ensure(self.kv.fact_spans(scope.key, missing, w))
                ready = [True] * len(ranked)
                sources.update({r.id: "encoded now" for r in missing})
            except DiskFullError as exc:  # no room for their KV: they come as text, as a miss does
                OUTAGES.failed("kv_disk", exc)
                ready = [self.kv.stored(k) for k in keys]
                sources.update({r.id: "text: KV disk full" for r, ok in zip(ranked, ready) if not ok})
        # the text tail: the best-ranked memories come as text even with KV, after the injected rest
        tail = {r.id for r, _ in hits[:options.text_tail]}
        inject = [ok and r.id not in tail for r, ok in zip(ranked, ready)]
        sources.update({r.id: "text: tail" for r, ok in zip(ranked, ready) if ok and r.id in tail})
        order = [i for i, ok in enumerate(inject) if ok] + [i for i, ok in enumerate(inject) if not ok]
        ranked, keys, ready = [ranked[i] for i in order], [keys[i] for i in order], [ready[i] for i in order]
        n_kv = sum(inject)
        missed = [i for i in range(n_kv, len(ranked)) if not ready[i]]  # text for want of KV (not the tail's)
        # the misses worth keeping (every one, or those used twice within kv_admission_window_s)
        admit = self.kv.admission.admit([keys[i] for i in missed], pressure=pool.under_pressure) if missed else []
        kept = [ranked[i] for i, keep in zip(missed, admit) if keep]
        capture = self.kv.capture and bool(kept) and not pool.disk_full
        self.kv.captures_seen |= bool(captured)
        if kept:
            if capture:
                self.kv.expect_captures(kept)  # before the jobs: their encode waits for it
            if not (capture and self.kv.captures_seen):
                # once captures are seen landing, a miss is captured by its own request and never
                # encoded: it costs its text prefill once (a connector that cannot capture is
                # never seen to, and its misses are encoded as before)
                self.kv.schedule(scope.key, kept, w)
        kv_keys = {PREAMBLE_OWNER: preamble.key, **{r.id: key for r, key in zip(ranked[:n_kv], keys[:n_kv])}}
        pool.use(kv_keys.values())  # recency on disk: what requests use is evicted last
        pool.count_served(None if r.id in tail else found[r.id] for r in ranked)  # None: text (or encoded now)
        pool.count_captured(len(captured))
        return _Selection(ranked, kv_keys, tuple(hits), retrieval,
                          tuple(r.id for r in ranked[:n_kv]), tuple(r.id for r in ranked[n_kv:]), sources,
                          self.kv.capture_request if capture else None, tuple(r.id for r in kept))


@dataclass(frozen=True)
class _Selection:
    """Retrieved facts in prompt order (stored KV first, then text; best-ranked last within
    each, or first with ``memory_order="best_first"``) and, in inject mode, the KV key of each injected segment by its owner (the
    preamble's :data:`~inferscale.generation.prompt.PREAMBLE_OWNER`, then the stored facts' ids)."""

    ranked: list[FactRecord]
    kv_keys: dict[str, str]
    hits: tuple[tuple[FactRecord, float], ...]
    retrieval_s: float
    kv_ids: tuple[str, ...]
    text_ids: tuple[str, ...]
    kv_sources: dict[str, str] = field(default_factory=dict)
    #: :meth:`KVManager.capture_request` when the memories served as text are to be captured
    capture: Callable[[Sequence[tuple[str, int, tuple[int, ...]]]], CaptureRequest | None] | None = None
    #: the text memories to capture (those the admission rule keeps)
    kept_ids: tuple[str, ...] = ()

    def plan(self, segments: Sequence[Segment]) -> InjectionPlan:
        """The injection of the preamble and the stored facts' lines, laid out as ``segments``
        (:func:`plan_segments`), asking the connector to capture the lines served as text."""
        plan = plan_segments(self.kv_keys, segments)
        if self.capture is None:
            return plan
        kept = set(self.kept_ids)
        request = self.capture([(seg.owner, seg.start, seg.token_ids) for seg in segments if seg.owner in kept])
        return plan if request is None else replace(plan, capture=request)


def plan_segments(kv_keys: dict[str, str], segments: Sequence[Segment]) -> InjectionPlan:
    """Pair each leading segment of a memory block with the KV of its own owner.

    Each segment's key is looked up by the segment's owner (a fact id, or the preamble's
    owner), never by position, and must name that owner (``"<owner>/<hash>"``); the injected
    segments are the leading run of segments that have KV.

    Args:
        kv_keys: the KV key of every segment to inject, by owner.
        segments: the memory block's segments in prompt order (``PromptBuilder.memory_segments``).

    Raises:
        ValueError: a key that names another owner, a segment with KV after one without
            (injected KV must be a prefix of the prompt), or a key with no segment.
    """
    planned = []
    for seg in segments:
        key = kv_keys.get(seg.owner)
        if key is None:
            break
        if key.split("/", 1)[0] != seg.owner:
            raise ValueError(f"the KV key {key} does not belong to segment {seg.owner}: the plan would inject "
                             "another memory's KV")
        planned.append((key, seg.start, len(seg.token_ids)))
    late = [seg.owner for seg in segments[len(planned):] if seg.owner in kv_keys]
    if late or len(planned) != len(kv_keys):
        raise ValueError(f"the memory block does not lead with its KV segments (owners {late or sorted(kv_keys)}): "
                         "segments with KV must come first, preamble at 0")
    return InjectionPlan.of(planned)


@dataclass(frozen=True)
class MemoryBlock:
    """A chat request's memory: see :meth:`RequestBuilder.prepare_memory_block`.

    Attributes:
        system_text: the system turn's text (system prompt, memories, the client's instructions).
        plan: what the connector injects (``None`` in text mode).
        hits: the retrieved facts and their scores, best first.
        retrieval_s: query embedding plus search (seconds).
        memory_tokens: tokens the plan covers (inject mode), or of preamble and fact lines (text).
        kv_memory_ids / text_memory_ids / kv_sources / scope_key: as in :class:`PreparedRequest`.
    """

    system_text: str
    plan: InjectionPlan | None
    hits: tuple[tuple[FactRecord, float], ...]
    retrieval_s: float
    memory_tokens: int
    kv_memory_ids: tuple[str, ...] = ()
    text_memory_ids: tuple[str, ...] = ()
    kv_sources: dict[str, str] = field(default_factory=dict)
    scope_key: str = ""

    @property
    def cache_salt(self) -> str:
        """The scope's prefix-cache salt (:func:`inferscale.kv.injection.cache_salt`), in either mode."""
        return cache_salt(self.scope_key, self.plan)


@dataclass(frozen=True)
class ServedChunk:
    """A piece of an answer: ``delta`` (new text) and, on the last piece, the engine's output."""

    delta: str
    text: str
    output: object | None = None


def run(engine: EngineLike, request: PreparedRequest) -> Iterator[ServedChunk]:
    """Send ``request`` to ``engine`` and yield the answer as it grows.

    The answer is the stripped text: leading and trailing whitespace is held back, so the
    deltas joined equal the final text. Closing the iterator early aborts the request.
    """
    o = request.options
    emitted = ""
    for chunk in engine.stream(request.prompt_token_ids, kv_transfer_params=request.kv_transfer_params,
                               cache_salt=request.cache_salt, max_tokens=o.max_tokens, temperature=o.temperature,
                               stop=o.stop, logprobs=o.logprobs, json_schema=request.json_schema):
        visible = chunk.text.strip()
        delta = visible[len(emitted):] if visible.startswith(emitted) else ""
        emitted += delta
        if chunk.output is not None or delta:
            yield ServedChunk(delta, visible, chunk.output)


def generation_chunks(engine: EngineLike, request: PreparedRequest) -> Iterator[GenerationChunk]:
    """:func:`run`, as the facade's chunks: each delta, and on the last chunk the whole
    :class:`~inferscale.types.Generation` (timings, token counts, memories as Mem0 items,
    which came as KV, parsed tool calls)."""
    memories = [r.to_item(s) for r, s in request.hits]
    for piece in run(engine, request):
        out = piece.output
        yield GenerationChunk(piece.delta, None if out is None else Generation(
            text=piece.text, mode=request.options.mode, ttft_s=out.ttft_s, latency_s=out.latency_s,
            retrieval_s=request.retrieval_s, num_prompt_tokens=out.num_prompt_tokens,
            num_injected_tokens=out.num_injected_tokens,
            num_prefilled_tokens=out.num_prompt_tokens - out.num_cached_tokens, memories=memories,
            first_logprobs=out.first_logprobs, num_generated_tokens=out.num_output_tokens,
            kv_memory_ids=list(request.kv_memory_ids), text_memory_ids=list(request.text_memory_ids),
            kv_sources=dict(request.kv_sources),
            tool_calls=[c.to_dict() for c in parse_tool_calls(piece.text, request.options.offered_tools())],
            finish_reason=out.finish_reason,
        ))
