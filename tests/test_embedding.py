"""The embedder's ONNX Runtime backend gives the torch backend's embeddings, exports once,
and repairs a damaged cached export."""

from __future__ import annotations

import pytest
import torch

from inferscale.config import DEFAULT_EMBEDDER
from inferscale.models.embedding import Embedder
from inferscale.models.embedding_onnx import onnx_plan
from inferscale.models.resolve import resolve_embedder

TEXTS = ["What did Caroline research?", "I have a dog called Rex and two cats.", "Where do I live?",
         "A much longer sentence " * 30]  # padded against the short ones in one batch


def test_onnx_backend_equals_torch_backend():
    onnx = Embedder(DEFAULT_EMBEDDER, "cpu", backend="onnx")
    torch_ = Embedder(DEFAULT_EMBEDDER, "cpu", backend="torch")
    a, b = onnx.encode(TEXTS), torch_.encode(TEXTS)
    assert onnx.backend_in_use == "onnx" and torch_.backend_in_use == "torch"
    assert a.shape == b.shape == (len(TEXTS), 384)
    assert torch.allclose(a, b, atol=1e-5)
    assert torch.allclose(a.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)
    one_by_one = torch.cat([onnx.encode([t]) for t in TEXTS])  # padding in a batch changes nothing
    assert torch.allclose(one_by_one, a, atol=1e-5)
    assert onnx.encode([]).shape == (0, 384)


def test_damaged_cached_export_is_exported_again(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERSCALE_CACHE_DIR", str(tmp_path))
    first = Embedder(DEFAULT_EMBEDDER, "cpu")
    expected = first.encode(TEXTS[:2])
    (path,) = tmp_path.glob("onnx/*/model.onnx")
    path.write_bytes(path.read_bytes()[:1000])  # truncated, as by a full disk
    again = Embedder(DEFAULT_EMBEDDER, "cpu")
    assert torch.allclose(again.encode(TEXTS[:2]), expected, atol=1e-6) and again.backend_in_use == "onnx"
    assert path.stat().st_size > 1_000_000


def test_backend_choice_is_checked():
    with pytest.raises(ValueError, match="embedder backend must be one of"):
        Embedder(DEFAULT_EMBEDDER, "cpu", backend="tensorrt")
    assert onnx_plan(resolve_embedder(DEFAULT_EMBEDDER)).pooling == "mean"
