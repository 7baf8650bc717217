"""The shape of a model's KV, from its Hugging Face config, and whether vLLM's paged cache
can hold one request.

    bytes/token = num_hidden_layers x 2 (K and V) x num_key_value_heads x head_dim x dtype bytes

(the layout of :class:`inferscale.kv.pool.FactKV` and of vLLM's paged cache per token).
vLLM refuses to start when ``kv_cache_memory_bytes`` cannot hold one request of
``max_model_len`` tokens, and says so in a traceback from its engine-core process that names
``gpu_memory_utilization``, a setting InferScale does not use. It counts whole blocks of
``block_size`` tokens (128 on the CPU backend, ``vllm/platforms/cpu.py``; 16 by default
elsewhere, ``vllm/config/cache.py``) and keeps one block back (the block pool's null block,
``vllm/v1/core/block_pool.py``): measured with vLLM 0.32 on the CPU, 360 MiB of SmolLM2's
fp32 KV (64 blocks) serves 8,064 tokens, 16 MiB (2 blocks) 128. :func:`check_kv_cache_fits`
asks the same first, in InferScale's terms.
"""

from __future__ import annotations

import json
from pathlib import Path

from inferscale.runtime.devices import torch_dtype

MIB = 1 << 20


def kv_dims(hf_config) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of the model's KV (``hf_config``: a
    ``transformers`` config, or any object with its attributes)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    return hf_config.num_hidden_layers, kv_heads, head_dim


def bytes_per_token(hf_config, dtype: str) -> int:
    """KV bytes per token, all layers, K and V, in ``dtype`` (see the module docstring).

    Raises:
        ValueError: an unknown dtype name.
    """
    layers, heads, dim = kv_dims(hf_config)
    return layers * 2 * heads * dim * torch_dtype(dtype).itemsize


class _Config:
    """The few fields of a model folder's ``config.json`` :func:`kv_dims` reads."""

    def __init__(self, fields: dict) -> None:
        text = fields.get("text_config") or {}  # multimodal configs nest the language model's
        self.__dict__.update({**fields, **text})


def block_tokens() -> int:
    """vLLM's default ``block_size`` here (tokens): 128 on the CPU backend, 16 on a GPU."""
    import torch

    return 16 if torch.cuda.is_available() else 128


def check_kv_cache_fits(model_path: Path, dtype: str, max_model_len: int, kv_cache_memory_bytes: int) -> None:
    """Refuse settings with which vLLM could not serve one request of ``max_model_len`` tokens
    (whole blocks, one kept back: the module docstring). A model folder whose ``config.json``
    cannot be read as a decoder's is left to vLLM.

    Args:
        model_path: the served model's folder. dtype: its KV dtype (``"float32"`` /
            ``"bfloat16"``). max_model_len: tokens. kv_cache_memory_bytes: bytes.

    Raises:
        ValueError: the cache is too small; the message gives the least cache that works,
            and the longest context that would (when at least ``max_model_len``'s least, 256).
    """
    try:
        config = _Config(json.loads((Path(model_path) / "config.json").read_text()))
        layers, heads, dim = kv_dims(config)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (layers, heads, dim)):
            return
        per_token = bytes_per_token(config, dtype)
    except (OSError, ValueError, TypeError, AttributeError, KeyError, ArithmeticError):
        return
    block = block_tokens()
    per_block = block * per_token
    usable = max(kv_cache_memory_bytes // per_block - 1, 0) * block  # tokens
    if usable >= max_model_len:
        return
    need = (-(-max_model_len // block) + 1) * per_block
    need = -(-need // MIB) * MIB  # whole MiB
    fixes = [f"raise kv_cache_memory_bytes to at least {need:,} bytes ({need // MIB:,} MiB; "
             "INFERSCALE_KV_CACHE_MEMORY_BYTES)"]
    if usable >= 256:  # max_model_len's least
        fixes.append(f"lower max_model_len to {usable:,} tokens or less (INFERSCALE_MAX_MODEL_LEN)")
    raise ValueError(
        f"kv_cache_memory_bytes ({kv_cache_memory_bytes:,} bytes) gives vLLM {usable:,} tokens of this model's KV "
        f"({per_token:,} bytes a token in {dtype}, in blocks of {block} with one kept back), fewer than "
        f"max_model_len ({max_model_len:,} tokens), so it could not serve one request: {' or '.join(fixes)}"
    )
