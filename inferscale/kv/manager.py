"""Keeps every fact's KV in the pool for the settings it is served with.

Owns the naming of KV (:func:`inferscale.kv.pool.kv_key` over the model fingerprint,
dtype, storage dtype, w, and the exact context and fact tokens), the building of Context-Window
Encoding contexts from the turn log, the lazy encoder, and the scheduling of encodes:
:meth:`KVManager.schedule` queues ``(fact, w)`` jobs durably and returns; the
:class:`~inferscale.kv.background.BackgroundEncoder` encodes them (:meth:`run_jobs`).

A job encodes the fact's *current* text (read from the store when the job runs), and
its key hashes those tokens, so an update racing an in-flight encode can never have the
old text's KV served for the new text; the old KV written after the update is removed.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from inferscale.kv.background import BackgroundEncoder
from inferscale.kv.admission import SecondUseAdmission
from inferscale.kv.capture import CaptureRequest, captured_key, token_digest
from inferscale.kv.encoder import EncodeItem, KVEncoder
from inferscale.kv.engine_encoder import EngineEncoder, EngineSpan
from inferscale.kv.jobs import KVJob, KVJobQueue
from inferscale.kv.pool import KVPool, kv_key, to_storage
from inferscale.kv.quant import STORAGE_DTYPES
from inferscale.kv.sizing import kv_file_bytes
from inferscale.runtime.logs import quiet_progress_bars
from inferscale.generation.prompt import PREAMBLE_OWNER, PromptBuilder
from inferscale.store.chroma import FactStore
from inferscale.store.records import FactRecord, Scope
from inferscale.store.turns import TurnLog


#: Part of every KV key: entries of an older format (format 1 stored no token ids) are
#: never found, so they are encoded again rather than served unverified.
KV_FORMAT = 2
#: jobs the background encoder takes at once when the engine encodes (it sends them in waves of
#: at most :data:`inferscale.kv.engine_encoder.MAX_IN_FLIGHT` requests anyway)
ENGINE_BATCH_JOBS = 8

#: ``kv_encoder``'s values: who computes a fact's KV (:class:`KVManager`)
KV_ENCODERS = ("engine", "transformers")

#: Fact KV keys kept by :meth:`KVManager.fact_keys` (~200 bytes each: ~40 MB when full).
_KEY_CACHE_SIZE = 200_000

#: Seconds a background job waits for KV a request asked the connector to capture before
#: encoding it: the connector stores a capture milliseconds after the request's prefill
#: (tests/test_capture.py); a capture that never lands (a cache the connector cannot read)
#: costs one wait, then the encode.
CAPTURE_WAIT_S = 5.0




@dataclass(frozen=True)
class FactSpan:
    """A fact's KV request: where its KV lives and what to encode if it is missing.

    Attributes:
        key: the pool key of the KV as stored (in the storage dtype).
        item: what the encoder runs when it is missing.
        model_key: for a quantized ``key``, the key of the same KV in the model's dtype: when
            that is in the pool, the KV is quantized from it instead of encoded again.
        other_keys: the keys of the same KV in the other storage dtypes: once ``key`` is
            stored, they are dropped from this machine's tiers (a storage switch replaces
            files, it does not add to them).
        scope_key: the scope whose turns the context holds (``""`` for the preamble).
    """

    key: str
    item: EncodeItem
    model_key: str | None = None
    other_keys: tuple[str, ...] = ()
    scope_key: str = ""


class KVManager:
    """Names, builds and looks up fact KV.

    Args:
        model_path: the served model's folder.
        fingerprint: :func:`inferscale.models.resolve.model_fingerprint` of it.
        dtype: KV dtype name.
        prompts: the prompt builder (its preamble starts every context).
        pool: the KV pool.
        turns: the conversation log.
        batch_tokens: encoder batch budget (tokens).
        max_tokens: longest encoding (context plus fact, tokens); the oldest window turns
            are dropped to fit.
        jobs: the durable queue of pending encodes (default: none; :meth:`schedule` then
            encodes at once).
        store: where a job's fact is read when the job runs (required with ``jobs``).
        storage: ``kv_storage_dtype``: ``"auto"`` (the model's dtype) or ``"int8"`` / ``"int4"``
            (:mod:`inferscale.kv.quant`); fact KV only, the preamble stays in the model's dtype.
        encode_when_idle: the background encoder waits, before each batch, until no request
            of this process is in flight (``encode_when_idle``; :class:`BackgroundEncoder`).
        encoder: ``kv_encoder``: ``"engine"`` (the serving engine computes every KV, a
            prefill-only request at low priority, :mod:`inferscale.kv.engine_encoder`; the
            engine comes from :meth:`use_engine`) or ``"transformers"`` (a copy of the model
            in this process, :class:`~inferscale.kv.encoder.KVEncoder`).
        capture: capture on a miss (``capture_kv``): requests ask the connector to keep the
            KV of memories they serve as text (:meth:`capture_request`), lookups fall back to
            captured KV (:meth:`captured_keys`), and a job whose memory was captured
            meanwhile is dropped, not encoded.
        admission_window_s: ``kv_admission_window_s``: a miss is kept (captured or queued
            for the encoder) only on its second use within this many seconds
            while the pool is under pressure (:class:`~inferscale.kv.admission.SecondUseAdmission`);
            0 keeps every miss.

    Raises:
        ValueError: an unknown ``storage`` or ``encoder``, a negative admission window.
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
        jobs: KVJobQueue | None = None,
        store: FactStore | None = None,
        verbose: bool = False,
        storage: str = "auto",
        encode_when_idle: bool = True,
        capture: bool = True,
        admission_window_s: float = 86_400.0,
        encoder: str = "transformers",
    ) -> None:
        if storage not in STORAGE_DTYPES:
            raise ValueError(f"kv_storage_dtype must be one of {', '.join(STORAGE_DTYPES)}, got {storage!r}")
        if encoder not in KV_ENCODERS:
            raise ValueError(f"kv_encoder must be one of {', '.join(KV_ENCODERS)}, got {encoder!r}")
        self.encoder_kind = encoder
        self._engine: Callable[[], Any] | None = None
        self._engine_encoder: EngineEncoder | None = None
        self.storage = storage
        self.capture = capture
        #: which misses are kept as KV (captured or encoded): all, or those used twice within a window
        self.admission = SecondUseAdmission(admission_window_s)
        #: background jobs dropped because a request had captured the memory's KV meanwhile
        self.jobs_captured = 0
        # captured keys requests asked for, and when (monotonic seconds): a job for one of them
        # waits a moment for the connector's write instead of encoding it (bounded)
        self._capture_asked: OrderedDict[str, float] = OrderedDict()
        #: a capture was seen in the pool: the connector captures, so a miss need not be encoded
        self.captures_seen = False
        self.model_path = model_path
        self.verbose = verbose
        self.fingerprint = fingerprint
        self.dtype = dtype
        self.prompts = prompts
        self.pool = pool
        self._closed = False
        self.turns = turns
        self.batch_tokens = batch_tokens
        self.max_tokens = max_tokens
        self._encoder: KVEncoder | None = None
        self._preamble: FactSpan | None = None
        #: keep a fact's KV in every storage dtype written (benchmarks that compare storage
        #: dtypes over one store set it; by default a write replaces the other dtypes' files)
        self.keep_other_storages = False
        # fact KV keys by (scope, turn-log version, fact id, text hash, sources, w): the hot
        # path names a retrieved fact's KV without SQL, tokenizing or hashing (bounded LRU)
        self._keys: OrderedDict[tuple, str] = OrderedDict()
        self._keys_lock = threading.Lock()
        self._encode_lock = threading.Lock()  # one encode at a time: the caller's or the background's
        self.jobs = jobs
        self.store = store
        self.background = BackgroundEncoder(jobs, self.run_jobs, requests_in_flight=lambda: pool.requests_in_flight,
                                            yield_to_requests=encode_when_idle) if jobs is not None else None

    def use_engine(self, engine: Callable[[], Any]) -> None:
        """Encode on the serving engine from now on (``kv_encoder="engine"``): ``engine()``
        returns it (:class:`inferscale.serving.engine.Engine`, or vLLM's server over HTTP).
        The encodes run below every request in vLLM's priority scheduling; the background
        encoder still sends each wave only while this process has no request in flight
        (``encode_when_idle``): vLLM schedules a running encode's step before a waiting
        request, so a request that arrives mid-wave waits for that wave's step."""
        self._engine = engine
        self.encoder_kind = "engine"
        if self.background is not None:
            # a batch's jobs are marked done together: small batches keep the count of what is
            # left (and a progress bar's estimate) current, at no cost to the engine's waves
            self.background.batch_jobs = ENGINE_BATCH_JOBS

    @property
    def engine_encoder(self) -> EngineEncoder | None:
        """The encoder on the serving engine (``kv_encoder="engine"``), ``None`` otherwise.

        Raises:
            RuntimeError: ``kv_encoder="engine"`` and no engine was given (:meth:`use_engine`).
        """
        if self.encoder_kind != "engine":
            return None
        if self._engine_encoder is None:
            if self._engine is None:
                raise RuntimeError("kv_encoder='engine' needs the serving engine: KVManager.use_engine(...) first")
            self._engine_encoder = EngineEncoder(self._engine, self.pool, self.capture_parts())
        return self._engine_encoder

    @property
    def engine_encodes(self) -> int:
        """Spans (memories' and the preamble's KV) the serving engine has encoded for this process."""
        return 0 if self._engine_encoder is None else self._engine_encoder.encoded

    @property
    def encoder_loaded(self) -> bool:
        """Whether this process loaded the LLM's weights to encode KV (the transformers encoder)."""
        return self._encoder is not None

    @property
    def encoder(self) -> KVEncoder:
        """The transformers model that encodes KV (loaded on first use): the encoder where
        ``kv_encoder="transformers"``, and the tests' reference either way."""
        if self._encoder is None:
            with quiet_progress_bars(self.verbose):
                self._encoder = KVEncoder(self.model_path, self.dtype, batch_tokens=self.batch_tokens)
        return self._encoder

    def fact_tokens(self, text: str) -> int:
        """Tokens of the fact's memory line (what its KV covers)."""
        return len(self.prompts.fact_line_ids(text))

    def invalidate(self, fact_id: str) -> None:
        """Drop every stored KV variant of a fact (on update and delete)."""
        self.pool.invalidate_owner(fact_id)

    def clear(self) -> None:
        """Drop all stored KV and every queued encode."""
        if self.jobs is not None:
            self.jobs.clear()
        self.pool.clear()

    def preamble_span(self) -> FactSpan:
        """The served preamble's KV request (computed again when the preamble changes: a
        template that renders the date)."""
        ids = self.prompts.preamble_ids
        if self._preamble is None or self._preamble.item.span_ids != ids:
            key = kv_key(PREAMBLE_OWNER, fmt=KV_FORMAT, fp=self.fingerprint, dtype=self.dtype, ids=token_digest(ids))
            self._preamble = FactSpan(key, EncodeItem((), ids))
        return self._preamble

    def fact_keys(self, scope_key: str, facts: Sequence[FactRecord], w: int) -> list[str]:
        """The pool key of each fact's KV at context window ``w``, from the cache where it can.

        A cached key is reused while the fact's text and sources, w and the scope's turn-log
        version (:meth:`TurnLog.version`, shared by every process over the data dir) are the
        same; anything else recomputes it through :meth:`fact_spans`.
        """
        version = self.turns.version(scope_key)
        keys: list[str | None] = []
        with self._keys_lock:
            for f in facts:
                cache_key = (scope_key, version, f.id, f.hash, f.source_turn_ids, w)
                key = self._keys.get(cache_key)
                if key is not None:
                    self._keys.move_to_end(cache_key)
                keys.append(key)
        missing = [i for i, k in enumerate(keys) if k is None]
        if missing:
            for i, span in zip(missing, self.fact_spans(scope_key, [facts[i] for i in missing], w, version)):
                keys[i] = span.key
        return keys  # type: ignore[return-value]

    def fact_spans(self, scope_key: str, facts: Sequence[FactRecord], w: int,
                   version: int | None = None) -> list[FactSpan]:
        """The KV request of each fact at context window ``w`` (turns): its key and what to encode.

        Args:
            version: the scope's turn-log version read before the turns (default: read now).
        """
        version = self.turns.version(scope_key) if version is None else version
        spans = []
        sources = self.turns.get(scope_key, sorted({t for f in facts for t in f.source_turn_ids}))
        for fact in facts:
            seqs = [sources[t].seq for t in fact.source_turn_ids if t in sources]
            window = self.turns.window(scope_key, min(seqs), w) if seqs and w > 0 else []
            span = self.prompts.fact_line_ids(fact.text)
            lines = [self.prompts.fact_line_ids(turn.render()) for turn in window]
            budget = self.max_tokens - len(self.prompts.context_preamble_ids) - len(span)
            while lines and sum(map(len, lines)) > budget:
                lines.pop(0)  # drop the oldest turns until the encoding fits the context
            context = list(self.prompts.context_preamble_ids)  # date-free: keys stay valid across days
            for line in lines:
                context.extend(line)
            parts = dict(fmt=KV_FORMAT, fp=self.fingerprint, dtype=self.dtype, w=w, ctx=token_digest(context),
                         span=token_digest(span))
            # "auto" has no storage part: keys made before the setting existed stay valid
            keys = {s: kv_key(fact.id, **parts) if s == "auto" else kv_key(fact.id, store=s, **parts)
                    for s in STORAGE_DTYPES}
            # encoded KV replaces the fact's KV in the other storage dtypes and its captured KV
            others = tuple(k for s, k in keys.items() if s != self.storage) + (
                captured_key(fact.id, self.capture_parts(), token_digest(span)),)
            spans.append(FactSpan(keys[self.storage], EncodeItem(tuple(context), span),
                                  None if self.storage == "auto" else keys["auto"], others, scope_key))
        with self._keys_lock:
            for fact, s in zip(facts, spans):
                self._keys[(scope_key, version, fact.id, fact.hash, fact.source_turn_ids, w)] = s.key
            while len(self._keys) > _KEY_CACHE_SIZE:
                self._keys.popitem(last=False)
        return spans

    def capture_parts(self) -> dict:
        """What a captured entry's key depends on besides its memory and tokens: the KV
        format, the model, its dtype and the storage dtype (:func:`~inferscale.kv.capture.captured_key`)."""
        parts: dict = dict(fmt=KV_FORMAT, fp=self.fingerprint, dtype=self.dtype)
        if self.storage != "auto":
            parts["store"] = self.storage
        return parts

    def captured_keys(self, facts: Sequence[FactRecord]) -> list[str]:
        """The pool key of each fact's captured KV (present or not)."""
        parts = self.capture_parts()
        return [captured_key(f.id, parts, token_digest(self.prompts.fact_line_ids(f.text))) for f in facts]

    def capture_request(self, spans: Sequence[tuple[str, int, list[int] | tuple[int, ...]]]) -> CaptureRequest | None:
        """What a request asks the connector to keep: ``(fact id, start, token ids)`` of each
        memory line it serves as text (``None`` when capture is off or there are none)."""
        if not self.capture or not spans:
            return None
        return CaptureRequest(self.capture_parts(), self.storage, self.pool.disk_budget_bytes,
                              tuple((owner, start, len(ids), token_digest(ids)) for owner, start, ids in spans))

    def expect_captures(self, facts: Sequence[FactRecord]) -> None:
        """Note that a request about to run serves ``facts`` as text and asks for their capture:
        a background job for them waits for it (:meth:`_captured_now`). Called before their
        jobs are queued, so the encoder, woken by the queue, never misses the note."""
        if not self.capture or not facts:
            return
        now = time.monotonic()
        with self._keys_lock:
            for key in self.captured_keys(facts):
                self._capture_asked[key] = now
                self._capture_asked.move_to_end(key)
            while len(self._capture_asked) > _KEY_CACHE_SIZE:
                self._capture_asked.popitem(last=False)

    def asked_captures(self, since: float = 0.0) -> list[str]:
        """Keys of the captured KV requests asked the connector for at or after ``since``
        (``time.monotonic()`` seconds; the last 200,000 asks), oldest first."""
        with self._keys_lock:
            return [k for k, t in self._capture_asked.items() if t >= since]

    def wait_for_captures(self, keys: Sequence[str], timeout_s: float) -> bool:
        """Wait until the pool holds every one of ``keys`` (captured KV asked for: the writer
        beside vLLM's worker stores it when the CPUs are free) or ``timeout_s`` seconds pass;
        returns whether all landed."""
        deadline = time.monotonic() + timeout_s
        while len(self.pool.present(keys)) < len(set(keys)):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True

    def _captured_now(self, keys: Sequence[str]) -> set[str]:
        """The ``keys`` the pool holds, after waiting up to :data:`CAPTURE_WAIT_S` (at least half a
        second) for those a request asked the connector to capture (it stores them from a thread of
        vLLM's process, just after the request's prefill; a job must not encode them meanwhile)."""
        t0 = time.monotonic()
        have = self.pool.present(keys)
        with self._keys_lock:
            asked = [self._capture_asked.get(k) for k in keys]
        pending = [t for k, t in zip(keys, asked) if k not in have and t is not None]
        # the write lands milliseconds after the prefill; a request that ran longer than the
        # wait was captured long before it ended, so half a second past now covers the rest
        deadline = max(max(pending, default=0.0) + CAPTURE_WAIT_S, time.monotonic() + 0.5)
        while pending and time.monotonic() < deadline:
            time.sleep(0.05)
            have = self.pool.present(keys)
            pending = [t for k, t in zip(keys, asked) if k not in have and t is not None]
        if self.background is not None:  # a job's wait for a capture to land is not encoding
            self.background.not_encoding(time.monotonic() - t0)
        self.captures_seen |= bool(have)
        return have

    def stored(self, key: str) -> bool:
        """Whether the KV of ``key`` is in the pool (no load)."""
        return self.pool.contains(key)

    def ensure(self, spans: Sequence[FactSpan], pause: Callable[[], None] | None = None) -> int:
        """Store every span's KV that is not in the pool, now: quantized from the model-dtype
        KV where the pool holds it (a storage-dtype switch costs no encode), else encoded.

        Args:
            pause: with the engine encoding, called before each wave of encodes and while their KV
                lands (the background encoder's wait for this process's requests to end; it may
                raise :class:`~inferscale.kv.background.EncoderClosing`).

        Returns:
            How many spans were stored (encoded or quantized).
        """
        have = self.pool.present(s.key for s in spans)
        if all(s.key in have for s in spans):
            return 0  # the common case on the serve path: never wait for an encode in flight
        with self._encode_lock:
            have = self.pool.present(s.key for s in spans)
            missing = {s.key: s for s in spans if s.key not in have}
            if not missing:
                return 0
            self.pool.check_writable()  # a full KV disk: no encode of KV that could not be stored
            quantized = self.quantize_stored(list(missing.values()))
            todo = [s for s in missing.values() if s.key not in quantized]
            engine = self.engine_encoder if todo else None
            if engine is not None:  # the serving engine computes it and its connector stores it
                spans = [EngineSpan(s.key, s.item.context_ids, s.item.span_ids,
                                    "auto" if s.model_key is None else self.storage, s.scope_key) for s in todo]
                # the writer is another process: a full disk is found here, not after a wait for KV that never lands
                self.pool.check_room(max(kv_file_bytes(self.model_path, self.dtype, s.storage, len(s.span_ids))
                                         for s in spans))
                engine.encode(spans, pause)
                for span in todo:
                    self.drop_other_variants(span)
                return len(missing)
            for span, kv in zip(todo, self.encoder.encode([s.item for s in todo])) if todo else ():
                self.pool.put(span.key, kv if span.model_key is None else to_storage(kv, self.storage))
                self.drop_other_variants(span)
            return len(missing)

    def drop_other_variants(self, span: FactSpan) -> None:
        """Drop ``span``'s KV in the other storage dtypes from this machine's tiers, now that
        its own is stored: after a ``kv_storage_dtype`` switch, a fact's old file goes as its
        new one is written (a shared Redis keeps its copies for deployments with other
        settings, and evicts them by its own policy)."""
        if self.keep_other_storages:
            return
        for key in span.other_keys:
            self.pool.remove(key, shared=False)

    def quantize_stored(self, spans: Sequence[FactSpan]) -> set[str]:
        """Store each quantized span whose model-dtype KV is in the pool, quantized from it
        (milliseconds a fact: done on the request path, so a storage switch never serves
        text for KV it has); returns the keys stored. Takes no lock: an entry is content-
        addressed, so two writers of a key write the same codes."""
        done: set[str] = set()
        have = self.pool.present(s.key for s in spans if s.model_key is not None)
        for span in spans:
            if span.model_key is None or span.key in have:
                continue
            dense = self.pool.get(span.model_key)
            if dense is not None and dense.token_ids == span.item.span_ids:
                self.pool.put(span.key, to_storage(dense, self.storage))
                self.drop_other_variants(span)
                done.add(span.key)
        return done

    # ------------------------------------------------------------------ background encoding

    def schedule(self, scope_key: str, facts: Sequence[FactRecord], w: int) -> None:
        """Queue the facts' KV at context window ``w`` (durable when this returns) and wake the
        background encoder; without a job queue, encode now."""
        if not facts:
            return
        if self.jobs is None or self.background is None:
            self.ensure([self.preamble_span(), *self.fact_spans(scope_key, facts, w)])
            return
        self.jobs.add((f.id, scope_key, w) for f in facts)
        self.background.notify()

    def unschedule(self, fact_ids: Sequence[str]) -> None:
        """Forget queued jobs of deleted facts."""
        if self.jobs is not None:
            self.jobs.drop_facts(fact_ids)

    def run_jobs(self, jobs: Sequence[KVJob]) -> None:
        """Encode a batch of jobs with each fact's current text (run by the background encoder).

        Raises:
            DiskFullError: the pool's disk still has no room (:meth:`ensure` checks before
                encoding; the encoder waits it out as an outage, :mod:`inferscale.kv.background`).
        """
        groups: dict[tuple[str, int], list[str]] = defaultdict(list)
        for job in jobs:
            groups[(job.scope, job.w)].append(job.fact_id)
        spans: list[tuple[FactRecord, FactSpan]] = []
        for (scope_key, w), ids in groups.items():
            assert self.store is not None, "a KVManager with a job queue needs the store"
            records = self.store.get(Scope.from_key(scope_key), ids)  # deleted facts are absent
            spans += list(zip(records, self.fact_spans(scope_key, records, w)))
        if self.capture and spans:  # a request captured the memory's KV meanwhile: nothing to encode
            ckeys = self.captured_keys([r for r, _ in spans])
            have = self._captured_now(ckeys)
            self.jobs_captured += sum(k in have for k in ckeys)
            spans = [pair for pair, k in zip(spans, ckeys) if k not in have]
        self.ensure([self.preamble_span(), *(s for _, s in spans)],
                    self.background.yield_now if self.background is not None else None)
        # an update or delete that landed during the encode: drop the KV of the old text
        by_scope: dict[str, list[str]] = defaultdict(list)
        for record, _ in spans:
            by_scope[record.scope.key].append(record.id)
        now = {r.id: r.hash for key, ids in by_scope.items() for r in self.store.get(Scope.from_key(key), ids)}
        for record, span in spans:
            if now.get(record.id) != record.hash:
                self.pool.remove(span.key)

    def pending(self, fact_ids: Sequence[str] | None = None) -> int:
        """Queued encodes (of ``fact_ids`` only, when given)."""
        return 0 if self.jobs is None else self.jobs.pending(fact_ids)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued encode is done; ``False`` if ``timeout`` (seconds) passed first."""
        return True if self.background is None else self.background.wait(timeout)

    def start(self) -> None:
        """Resume jobs left queued by an earlier process (a crash, or a close with work pending)."""
        if self.background is not None and self.pending() > 0:
            self.background.notify()

    def close(self) -> None:
        """Stop the background encoder after its current batch (queued jobs stay queued) and
        let go of the pool (:meth:`KVPool.release`), once however often it is called."""
        if self.background is not None:
            self.background.close()
        if not self._closed:
            self._closed = True
            self.pool.release()
