"""Opening a data dir: every component of one memory store, wired in one place.

:func:`open_components` resolves the models, checks the data dir, opens the stores (Chroma,
the turn log, the history, the KV job queue, the KV pool) and builds the services over
them (embedder, index, KV manager, fact service, request builder), in dependency order,
and returns them as one typed :class:`Components`. :class:`~inferscale.memory.Memory` is
the Mem0-style facade over that bundle; tests and tools that need a component read it
from ``memory.components``.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inferscale.checks import first_line
from inferscale.config import MemoryConfig
from inferscale.store.embedded import (embedded_count, hidden_memories_message, moved_message, read_manifest,
                                      write_manifest)
from inferscale.models.embedding import Embedder
from inferscale.facts.writes import FactService
from inferscale.store.history import HistoryLog
from inferscale.store.index import VectorIndex
from inferscale.runtime.devices import best_device
from inferscale.kv.jobs import KVJobQueue
from inferscale.kv.manager import KVManager
from inferscale.kv.pool import KVPool
from inferscale.kv.garbage import Served, collect as collect_unserved
from inferscale.models.resolve import model_fingerprint, resolve_embedder, resolve_llm
from inferscale.generation.prompt import PromptBuilder
from inferscale.generation.request import RequestBuilder
from inferscale.store.sql import Database
from inferscale.store.chroma import REEMBEDDING_KEY, FactStore, reembed_command, reembed_message
from inferscale.store.records import SCHEMA_VERSION, StoreError
from inferscale.store.turns import TurnLog
from inferscale.store.chat_log import ChatLog

@dataclass(frozen=True)
class Components:
    """Everything one memory store is made of, opened over one data dir.

    Attributes:
        config: the settings it was opened with.
        model_path: the served LLM's local folder. tokenizer: its tokenizer.
        prompts: the prompt layout around the memory block.
        device: where the index and the KV pool's device tier live.
        kv_dir: the KV pool's disk folder (``<data_dir>/kv``; vLLM's connector reads it).
        store: Chroma, the system of record. turns: the conversation log.
        history_log: ADD / UPDATE / DELETE events. kv_jobs: the durable KV encode queue.
        chats: what each chat served by the front used (in the history's database).
        pool: fact KV (device LRU tier over safetensors files).
        embedder: query and fact embeddings. index: exact top-k per scope.
        kv: Context-Window Encoding, KV naming and the background encoder.
        facts: ordered, locked writes and reads of facts.
        requests: retrieval, prompt layout and the injection plan of one request.
    """

    config: MemoryConfig
    model_path: Path
    tokenizer: Any
    prompts: PromptBuilder
    device: torch.device
    kv_dir: Path
    store: FactStore
    turns: TurnLog
    history_log: HistoryLog
    kv_jobs: KVJobQueue
    pool: KVPool
    embedder: Embedder
    index: VectorIndex
    kv: KVManager
    facts: FactService
    requests: RequestBuilder
    chats: ChatLog


def resolve_models(config: MemoryConfig) -> tuple[Path, Path | str, Any]:
    """The LLM's folder, the embedder's source and the LLM's tokenizer; touches no data dir.

    Raises:
        inferscale.models.resolve.ModelNotFoundError: the LLM or embedder cannot be found.
    """
    from transformers import AutoTokenizer

    model_path = resolve_llm(config.llm)
    embedder_source = resolve_embedder(config.embedder)
    return model_path, embedder_source, AutoTokenizer.from_pretrained(str(model_path))


def open_components(config: MemoryConfig, models: tuple[Path, Path | str, Any] | None = None) -> Components:
    """Open the store in ``config.data_dir`` (created when missing) and wire its components.

    Args:
        config: the settings.
        models: what :func:`resolve_models` returned, when the caller resolved them first.

    Raises:
        inferscale.models.resolve.ModelNotFoundError: the LLM or embedder cannot be found.
        inferscale.store.records.StoreError: the data dir cannot be used (unwritable, written by a
            newer version or with another embedder, damaged), the database or the Chroma
            server cannot be reached, or ``chroma_url`` would hide the embedded store's memories.
    """
    model_path, embedder_source, tokenizer = models or resolve_models(config)
    prompts = PromptBuilder(tokenizer, config.system_prompt)  # before the data dir: a failure writes nothing
    data = config.data_dir
    manifest = check_data_dir(data, config.embedder, config.chroma_url)
    if config.chroma_url is not None and not config.hide_embedded_memories:
        hidden = embedded_count(data)  # memories the server would hide: refused, never silently
        if hidden:
            raise StoreError(hidden_memories_message(data, hidden, config.chroma_url))
    device = best_device()
    kv_dir = data / "kv"
    store = None
    try:
        store = FactStore(data / "chroma", config.chroma_server(), embedder=config.embedder)
        turns, history_log = _logs(config)
        chats = ChatLog(history_log.db)
        kv_jobs = KVJobQueue(data / "kv_jobs.sqlite")
    except (StoreError, ImportError):
        raise
    except Exception as exc:  # sqlite, chromadb and OS errors on a damaged store
        raise StoreError(f"cannot open the store at {data} ({type(exc).__name__}: {exc}): move the damaged "
                         "file aside or choose another data_dir") from exc
    try:  # a ValueError here (the folder open with other settings) says what to do as it is
        pool = KVPool.shared(kv_dir, device, config.device_kv_budget_bytes, config.host_kv_budget_bytes,
                             config.disk_kv_budget_bytes, config.kv_redis_url)
    except OSError as exc:
        raise StoreError(f"cannot open the KV folder {kv_dir} ({type(exc).__name__}: {exc}): move it aside or "
                         "choose another data_dir") from exc
    try:
        pool.enforce_budget()  # a budget lowered since the folder was filled holds from the start
        fingerprint = model_fingerprint(model_path)
        if pool.holders == 1:  # the process's first memory over the folder: KV no longer served goes
            collect_unserved(pool.disk, Served(fingerprint, config.resolved_dtype, config.kv_storage_dtype))
        if manifest is not None:
            write_manifest(data, manifest)
        embedder = Embedder(config.embedder, device, source=embedder_source, backend=config.embedder_backend)
        # partitions load on first use, and catch up on (or reload after) other processes' writes
        index = VectorIndex(device, loader=store.load_scope, versioner=history_log.scope_version,
                            changes=history_log.changes_since, fetch=store.fetch,
                            keyword_docs=turns.keyword_docs if config.keyword_turns else None)
        kv = KVManager(model_path, fingerprint, config.resolved_dtype, prompts, pool, turns,
                       config.encode_batch_tokens, config.max_model_len, jobs=kv_jobs, store=store,
                       verbose=config.verbose, storage=config.kv_storage_dtype,
                       encode_when_idle=config.encode_when_idle, capture=config.capture_kv,
                       admission_window_s=config.kv_admission_window_s)
        facts = FactService(store, index, embedder, kv, history_log, config.context_window, config.precompute_kv,
                            config.max_fact_tokens, config.search_mode, config.max_query_chars)
        requests = RequestBuilder(facts, prompts, kv, turns, config.max_model_len)
    except BaseException:
        pool.release()  # a retry with other settings must not find this half-open pool
        if store is not None:
            store.close()  # nor a re-embed this store's open lock
        raise
    return Components(config=config, model_path=model_path, tokenizer=tokenizer, prompts=prompts, device=device,
                      kv_dir=kv_dir, store=store, turns=turns, history_log=history_log, kv_jobs=kv_jobs, pool=pool,
                      embedder=embedder, index=index, kv=kv, facts=facts, requests=requests, chats=chats)


def _logs(config: MemoryConfig) -> tuple[TurnLog, HistoryLog]:
    """The turn log and the history: two SQLite files in the data dir, or one shared database."""
    if config.database_url is None:
        return (TurnLog(Database.sqlite_file(config.data_dir / "turns.sqlite")),
                HistoryLog(Database.sqlite_file(config.data_dir / "history.sqlite")))
    shared = Database(config.database_url)
    try:
        return TurnLog(shared), HistoryLog(shared)
    except Exception as exc:  # noqa: BLE001 - sqlalchemy.exc.OperationalError and kin
        raise StoreError(f"cannot use the database at {shared.describe()} ({first_line(exc)}): check "
                         "database_url and that the server is running") from None


def check_data_dir(data: Path, embedder: str, chroma_url: str | None = None) -> dict | None:
    """Create the data dir, check it is writable and check its manifest (schema version,
    embedder; a data dir whose memories moved to a Chroma server is opened with it only).
    Returns the manifest to write once the store opened, or ``None`` if one exists.

    Raises:
        inferscale.store.records.StoreError: unwritable, not JSON, a newer schema, another
            embedder, or memories moved to a server and no ``chroma_url``.
    """
    try:
        data.mkdir(parents=True, exist_ok=True)
        # a probe of its own: processes opening the folder together (serve's workers) must not
        # delete each other's and call the folder unwritable
        with tempfile.NamedTemporaryFile(dir=data, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise StoreError(f"cannot use data_dir {data}: {exc}. Choose a writable folder.") from exc
    manifest = {"schema_version": SCHEMA_VERSION, "embedder": embedder}
    found = read_manifest(data)
    if found is None:
        return manifest
    if found.get("schema_version", 0) > SCHEMA_VERSION:
        raise StoreError(f"the store at {data} has schema version {found['schema_version']}, newer than this "
                         f"InferScale's {SCHEMA_VERSION}: upgrade inferscale to open it")
    moved = moved_message(data, found) if chroma_url is None else None
    if moved:  # its memories are on a server: the empty embedded store would hide them
        raise StoreError(moved)
    if REEMBEDDING_KEY in found:
        raise StoreError(f"a re-embed of the memories at {data} with {found[REEMBEDDING_KEY]!r} stopped half-way: run "
                         f"`{reembed_command(found[REEMBEDDING_KEY], data)}` again to finish it")
    if found.get("embedder") != embedder:
        raise StoreError(reembed_message(str(data), found.get("embedder"), embedder, reembed_command(embedder, data)))
    return None
