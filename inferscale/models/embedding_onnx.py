"""A sentence-transformers model run by ONNX Runtime: the CPU backend of :class:`Embedder`.

On the 2-core CPU machines of this project, all-MiniLM-L6-v2 embeds one query in about a
sixth of the time sentence-transformers' torch path takes, with embeddings equal to
1e-6 (docs/decisions.md, "issue 11: query embedding"). sentence-transformers' own ONNX
backend needs ``optimum-onnx``, which pins ``transformers<4.58`` and cannot be installed
beside vLLM, so the model is exported here once with ``torch.onnx`` (its TorchScript
exporter) and cached under ``<cache_dir>/onnx/<model fingerprint>/``.

Supported: models whose ``modules.json`` is a Transformer, then a mean- or CLS-token
Pooling, then optionally Normalize (the common case, all-MiniLM-L6-v2 included);
:func:`onnx_plan` says ``None`` for anything else and the torch path is used.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"
_BATCH = 32  # texts per ONNX Runtime call when embedding many
_EXPORT_LOCK = threading.Lock()  # torch.onnx.export keeps global state: one export at a time


@dataclass(frozen=True)
class OnnxPlan:
    """What the exported graph must reproduce of a sentence-transformers model.

    Attributes:
        folder: the model folder (``modules.json``, the Hugging Face transformer at its root).
        pooling: ``"mean"`` (masked mean over tokens) or ``"cls"`` (the first token).
        normalize: L2-normalise the pooled vector.
        max_seq_length: tokens kept per text (longer texts are truncated, as the model does).
    """

    folder: Path
    pooling: str
    normalize: bool
    max_seq_length: int


def onnx_plan(folder: str | Path) -> OnnxPlan | None:
    """How to run the sentence-transformers model in ``folder`` with ONNX Runtime, or
    ``None`` when its module stack is not Transformer -> Pooling(mean|cls) [-> Normalize]."""
    folder = Path(folder)
    try:
        modules = json.loads((folder / "modules.json").read_text())
        types = [m["type"] for m in sorted(modules, key=lambda m: m["idx"])]
        if types not in ([_TRANSFORMER, _POOLING], [_TRANSFORMER, _POOLING, _NORMALIZE]) or modules[0]["path"]:
            return None
        pool = json.loads((folder / modules[1]["path"] / "config.json").read_text())
        st_config = folder / "sentence_bert_config.json"
        max_len = json.loads(st_config.read_text()).get("max_seq_length") if st_config.exists() else None
    except (OSError, KeyError, IndexError, TypeError, json.JSONDecodeError):
        return None
    modes = [k for k, v in pool.items() if k.startswith("pooling_mode_") and v]
    if modes == ["pooling_mode_mean_tokens"]:
        pooling = "mean"
    elif modes == ["pooling_mode_cls_token"]:
        pooling = "cls"
    else:
        return None
    return OnnxPlan(folder, pooling, len(types) == 3, int(max_len or 512))


def export(plan: OnnxPlan, path: Path) -> Path:
    """Export the plan's transformer to ``path`` (ONNX, inputs ``input_ids``,
    ``attention_mask``, ``token_type_ids`` ``[batch, seq]`` int64; output the last hidden
    state ``[batch, seq, hidden]`` float32). Written to a temporary file and renamed, so a
    crash never leaves a half-written model. Returns ``path``.

    Raises:
        RuntimeError: the model cannot be exported (the message says which backend to use).
    """
    with _EXPORT_LOCK:
        if path.exists():  # another thread exported it while this one waited
            return path
        return _export(plan, path)


def _export(plan: OnnxPlan, path: Path) -> Path:
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(plan.folder), torch_dtype=torch.float32).eval()

    class _Hidden(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    sample = torch.ones((1, 4), dtype=torch.int64)
    names = ["input_ids", "attention_mask", "token_type_ids"]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        torch.onnx.export(_Hidden(model), (sample, sample, torch.zeros_like(sample)), str(tmp), input_names=names,
                          output_names=["last_hidden_state"], opset_version=17, dynamo=False,
                          dynamic_axes={n: {0: "batch", 1: "seq"} for n in [*names, "last_hidden_state"]})
        os.replace(tmp, path)
    except Exception as exc:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"cannot export embedder {plan.folder} to ONNX ({type(exc).__name__}: {exc}): "
                           "set embedder_backend='torch' (INFERSCALE_EMBEDDER_BACKEND=torch)") from exc
    return path


class OnnxEncoder:
    """Embeds texts with an exported model on ONNX Runtime's CPU execution provider.

    Args:
        plan: from :func:`onnx_plan`.
        onnx_path: the exported graph (:func:`export`).
        threads: ONNX Runtime intra-op threads (default: the CPU count, at most 4).

    Thread-safe (ONNX Runtime sessions are; the tokenizer is used under a lock).
    """

    def __init__(self, plan: OnnxPlan, onnx_path: Path, threads: int | None = None) -> None:
        import onnxruntime as ort
        from transformers import AutoTokenizer

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or min(4, os.cpu_count() or 1)
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3  # errors only
        # no busy-waiting after a call: spinning threads would hold the cores vLLM's engine
        # needs right after retrieval (TTFT of every request with k > 0 rose ~60 ms with it)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
        self._inputs = {i.name for i in self._session.get_inputs()}
        self._tokenizer = AutoTokenizer.from_pretrained(str(plan.folder))
        self._lock = threading.Lock()
        self.plan = plan

    def encode(self, texts: list[str]) -> np.ndarray:
        """Embed ``texts``: ``[len(texts), dim]`` float32 (L2-normalised when the model normalises)."""
        out = [self._batch(texts[i : i + _BATCH]) for i in range(0, len(texts), _BATCH)]
        return np.concatenate(out) if out else np.zeros((0, 0), dtype=np.float32)

    def _batch(self, texts: list[str]) -> np.ndarray:
        with self._lock:
            enc = self._tokenizer(texts, padding=True, truncation=True, max_length=self.plan.max_seq_length,
                                  return_tensors="np")
        ids = enc["input_ids"].astype(np.int64)
        mask = enc["attention_mask"].astype(np.int64)
        feed = {"input_ids": ids, "attention_mask": mask,
                "token_type_ids": enc.get("token_type_ids", np.zeros_like(ids)).astype(np.int64)}
        hidden = self._session.run(None, {k: v for k, v in feed.items() if k in self._inputs})[0]
        if self.plan.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            pooled = (hidden * mask[..., None]).sum(1) / np.maximum(mask.sum(1, keepdims=True), 1)
        if self.plan.normalize:
            pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return pooled.astype(np.float32)
