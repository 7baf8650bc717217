"""Fact KV made by the serving engine: an encode is a prefill-only request to vLLM.

The transformers encoder (:class:`inferscale.kv.encoder.KVEncoder`) runs a second copy of the
model in the process that adds memories, outside vLLM's scheduler. :class:`EngineEncoder`
sends the same work to the engine that serves the model instead (docs/decisions.md, "The
engine computes the KV"):

- one request per span: the Context-Window Encoding context (the preamble and the w turns
  before the fact's source turn) followed by the fact's memory line, ``max_tokens=1``;
- its ``kv_transfer_params`` ask the connector to capture the line's span under the fact's
  encoded key (:class:`~inferscale.kv.capture.CaptureRequest`, a span with its key): after the
  step that computed it, the worker reads the span's K and V out of the paged cache and the
  capture writer inverse-rotates the keys and stores them, in the storage dtype, in the pool's
  disk tier (and Redis) that every process reads;
- it runs at :data:`ENCODE_PRIORITY`, below every request (priority 0), under vLLM's priority
  scheduling: vLLM orders the encodes after waiting requests and preempts them for one;
- it carries the scope's prefix-cache salt, so consecutive facts of one turn share their
  context's blocks through vLLM's prefix cache (and no other scope does).

The request returns when vLLM has finished it; the KV lands a moment later (the writer runs
at nice 19). :meth:`EngineEncoder.encode` waits for every key in the pool, at most
``store_timeout_s``.

Works with any engine face that takes ``generate(prompt_token_ids, max_tokens=,
kv_transfer_params=, cache_salt=, priority=)``: the in-process engine
(:class:`inferscale.serving.engine.Engine`) and vLLM's OpenAI server over HTTP
(:class:`inferscale.server.upstream.HttpEngine`).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from inferscale.kv.capture import CAPTURE_FIELD, CaptureRequest, token_digest
from inferscale.kv.injection import PARAMS_KEY, cache_salt
from inferscale.kv.pool import KVPool

#: vLLM priority of an encode (lower is served first; requests carry 0)
ENCODE_PRIORITY = 1
#: most encodes in flight at once, and most prompt tokens of encodes in flight (a wave): vLLM
#: schedules running requests before waiting ones, so a request that arrives during a wave shares
#: its steps; a small wave keeps that wait to a step of about this many tokens (the first encode of
#: a wave is sent whatever its length)
MAX_IN_FLIGHT = 4
MAX_WAVE_TOKENS = 256


class EncodeTimeout(TimeoutError):
    """The engine finished the encodes but their KV did not reach the pool in time (the capture
    writer is far behind, or could not store it: a full disk, a cache layout it cannot read)."""


@dataclass(frozen=True)
class EngineSpan:
    """One encode: where the KV goes and what the engine prefills.

    Attributes:
        key: the pool key to store the span's KV under (its owner is the key's first part).
        context_ids: tokens before the span (their KV is not kept).
        span_ids: the tokens whose KV is kept (at least one).
        storage: ``kv_storage_dtype`` to store it in (``"auto"``: the model's dtype).
        scope_key: the scope whose turns the context holds (its prefix-cache salt; ``""``: none).
    """

    key: str
    context_ids: tuple[int, ...]
    span_ids: tuple[int, ...]
    storage: str = "auto"
    scope_key: str = ""

    def request(self, parts: dict, disk_budget_bytes: int | None) -> tuple[list[int], dict]:
        """The prompt (tokens) and ``kv_transfer_params`` of this encode: no injection, one capture."""
        owner = self.key.split("/", 1)[0]
        capture = CaptureRequest(parts, self.storage, disk_budget_bytes,
                                 ((owner, len(self.context_ids), len(self.span_ids), token_digest(self.span_ids),
                                   self.key),))
        params = {PARAMS_KEY: {"memory_end": 0, "segments": [], CAPTURE_FIELD: capture.to_params()}}
        return [*self.context_ids, *self.span_ids], params


def waves(spans: Sequence[EngineSpan]) -> list[list[EngineSpan]]:
    """``spans`` in order, cut into waves of at most :data:`MAX_IN_FLIGHT` spans and
    :data:`MAX_WAVE_TOKENS` prompt tokens (a longer span is a wave of its own)."""
    out: list[list[EngineSpan]] = []
    tokens = 0
    for s in spans:
        n = len(s.context_ids) + len(s.span_ids)
        if not out or len(out[-1]) >= MAX_IN_FLIGHT or tokens + n > MAX_WAVE_TOKENS:
            out.append([])
            tokens = 0
        out[-1].append(s)
        tokens += n
    return out


class EngineEncoder:
    """Encodes spans on the serving engine (module docstring).

    Args:
        engine: returns the engine to send encodes to (called once per batch: an embedded
            memory starts its engine on first use).
        pool: where the KV lands (its disk tier, shared with vLLM's connector).
        parts: the capture key parts (:meth:`inferscale.kv.manager.KVManager.capture_parts`);
            unused for spans that name their key, but the wire format carries them.
        store_timeout_s: most seconds to wait, after the engine finished, for the KV to land.
    """

    def __init__(self, engine: Callable[[], Any], pool: KVPool, parts: dict, store_timeout_s: float = 300.0) -> None:
        self._engine = engine
        self.pool = pool
        self.parts = parts
        self.store_timeout_s = store_timeout_s
        #: spans encoded, and the engine's seconds on them (wall time of the batches)
        self.encoded = 0
        self.engine_s = 0.0

    def encode(self, spans: Sequence[EngineSpan], pause: Callable[[], None] | None = None) -> None:
        """Encode ``spans`` on the engine, in waves of at most :data:`MAX_IN_FLIGHT` requests and
        :data:`MAX_WAVE_TOKENS` prompt tokens, and wait until the pool holds each one's KV.

        Args:
            pause: called before each wave and while the KV lands (the background encoder's
                wait for this process's requests in flight to end; it raises
                :class:`~inferscale.kv.background.EncoderClosing` when the encoder is closing,
                which ends the encode there).

        Raises:
            EncodeTimeout: the KV of some spans did not land within ``store_timeout_s``.
            Exception: what the engine raised (vLLM's server not answering: an outage the
                background encoder waits out).
        """
        if not spans:
            return
        t0 = time.perf_counter()
        engine = self._engine()
        budget = self.pool.disk_budget_bytes

        def one(span: EngineSpan) -> None:
            prompt, params = span.request(self.parts, budget)
            engine.generate(prompt, max_tokens=1, temperature=0.0, kv_transfer_params=params,
                            cache_salt=cache_salt(span.scope_key, None), priority=ENCODE_PRIORITY)

        with ThreadPoolExecutor(max_workers=min(MAX_IN_FLIGHT, len(spans)), thread_name_prefix="inferscale-encode") as ex:
            for wave in waves(spans):
                if pause is not None:
                    pause()
                for future in [ex.submit(one, s) for s in wave]:
                    future.result()
        keys = [s.key for s in spans]
        deadline = time.monotonic() + self.store_timeout_s
        while len(have := self.pool.present(keys)) < len(set(keys)):
            if time.monotonic() >= deadline:
                missing = sorted(set(keys) - have)
                raise EncodeTimeout(f"the engine encoded {len(keys)} span(s) but the KV of {len(missing)} did not "
                                    f"reach the pool within {self.store_timeout_s:g} s (first: {missing[0]}): see "
                                    "vLLM's log for capture errors (vllm:inferscale_capture_errors_total)")
            if pause is not None:
                pause()
            time.sleep(0.02)
        self.pool.note_stored_elsewhere(keys)
        self.encoded += len(spans)
        self.engine_s += time.perf_counter() - t0
