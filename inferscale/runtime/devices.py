"""Devices and dtypes by name: where a component computes and in what precision.

Imports torch only, so vLLM's engine process (the KV connector) can name its device
without loading the KV encoder or the model registry.
"""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; raises ``ValueError`` for unknown names."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use one of {sorted(_DTYPES)}") from None


def best_device() -> torch.device:
    """``cuda`` when a CUDA GPU is present, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
