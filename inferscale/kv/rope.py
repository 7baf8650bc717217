"""Chunked RoPE: rotate stored pre-RoPE keys to the positions they are served at.

The angles come from the model family's own rotary-embedding module in transformers
(``LlamaRotaryEmbedding``, ``Qwen3RotaryEmbedding``, ...), built from the model's
config, so ``rope_theta``, ``rope_scaling`` / ``rope_parameters`` (linear, llama3,
yarn, ...), ``partial_rotary_factor`` and ``head_dim`` are honoured exactly as the
model itself honours them; nothing is re-derived here.

Rotation convention: the "rotate half" (GPT-NeoX) layout used by the Llama, Qwen2/3
and Mistral families: ``y = x * cos + rotate_half(x) * sin`` over the first
``rotary_dim`` channels of each head, the rest passed through.

Inverse: the rotation is orthogonal up to the scalar ``attention_scaling`` that some
rope types (yarn) fold into cos and sin, so
``x = (y * cos - rotate_half(y) * sin) / (cos^2 + sin^2)``: the same cos/sin with the
sign of sin flipped, divided by the squared scale (1 for most models).
"""

from __future__ import annotations

import importlib

import torch
from torch import nn


class UnsupportedRopeError(ValueError):
    """The model's rotary embedding cannot be reproduced outside the model."""


def _find_rotary_class(config) -> type[nn.Module]:
    model_type = getattr(config, "model_type", None)
    if not model_type:
        raise UnsupportedRopeError("the model config has no model_type; cannot find its rotary embedding")
    module_name = f"transformers.models.{model_type.replace('-', '_')}.modeling_{model_type.replace('-', '_')}"
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnsupportedRopeError(f"transformers has no module {module_name} for model_type {model_type!r}") from exc
    candidates = [
        obj
        for name, obj in vars(module).items()
        if name.endswith("RotaryEmbedding") and isinstance(obj, type) and issubclass(obj, nn.Module)
    ]
    if not candidates:
        raise UnsupportedRopeError(f"model_type {model_type!r} has no rotary embedding (is it a RoPE model?)")
    # Prefer the family's main class (e.g. LlamaRotaryEmbedding over variants).
    candidates.sort(key=lambda c: len(c.__name__))
    return candidates[0]


class RopeRotator:
    """Applies and inverts the model's rotary position embedding on keys.

    Args:
        config: the model's transformers ``PretrainedConfig`` (as loaded by
            ``AutoConfig``, or vLLM's ``model_config.hf_config``).

    Raises:
        UnsupportedRopeError: the model has no rotary embedding in transformers, or its
            rope type depends on the sequence length (``dynamic``), which would make a
            stored key's rotation depend on the request.
    """

    def __init__(self, config) -> None:
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
        if rope_type == "dynamic":
            raise UnsupportedRopeError(
                "rope_type 'dynamic' rescales angles with the sequence length, so stored keys cannot be "
                "rotated independently of the request; use a model with a static rope type"
            )
        self._module = _find_rotary_class(config)(config=config)
        self._module.eval()

    @torch.no_grad()
    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Cos and sin tables for ``positions``.

        Args:
            positions: ``[num_tokens]`` int64 absolute positions (tokens).

        Returns:
            ``(cos, sin)``, each ``[num_tokens, rotary_dim]`` in ``dtype``, on
            ``positions.device``.
        """
        probe = torch.empty(0, dtype=torch.float32, device=positions.device)
        self._module.to(positions.device)
        cos, sin = self._module(probe, positions.view(1, -1))
        return cos[0].to(dtype), sin[0].to(dtype)

    def _apply(self, keys: torch.Tensor, positions: torch.Tensor, inverse: bool,
               tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        # keys: [..., num_tokens, num_kv_heads, head_dim]; positions: [num_tokens]
        if keys.shape[-3] != positions.shape[0]:
            raise ValueError(f"keys have {keys.shape[-3]} tokens but {positions.shape[0]} positions were given")
        if tables is not None and tables[0].shape[0] != positions.shape[0]:
            raise ValueError(f"cos/sin tables cover {tables[0].shape[0]} positions but {positions.shape[0]} were given")
        cos, sin = tables if tables is not None else self.cos_sin(positions.to(keys.device))  # fp32 [T, rotary_dim]
        rot = cos.shape[-1]
        cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
        x = keys.float()
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        # x*cos + rotate_half(x)*sin written in place, with no rotate_half or concatenation
        # temporaries (it runs on every injected token); the inverse is the rotation by minus
        # the angle, (x*cos - rotate_half(x)*sin) / (cos^2 + sin^2) (the denominator is 1 but
        # for scaled types such as YaRN, whose tables carry an attention factor), the division
        # folded into the [T, rot] tables, so the same few ops: a captured miss is unrotated
        # on the engine's worker, beside the requests
        half = rot // 2
        sign = -1.0 if inverse else 1.0
        if inverse:
            norm = cos * cos + sin * sin
            cos, sin = cos / norm, sin / norm
        out = torch.empty_like(x)
        torch.mul(x_rot, cos, out=out[..., :rot]) if x_pass.shape[-1] else torch.mul(x, cos, out=out)
        out[..., :half].addcmul_(x_rot[..., half:], sin[..., :half], value=-sign)
        out[..., half:rot].addcmul_(x_rot[..., :half], sin[..., half:], value=sign)
        if x_pass.shape[-1]:
            out[..., rot:] = x_pass
        return out.to(keys.dtype)

    def rotate(self, keys: torch.Tensor, positions: torch.Tensor,
               tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Rotate pre-RoPE keys to ``positions``.

        Args:
            keys: ``[..., num_tokens, num_kv_heads, head_dim]`` pre-RoPE keys (any leading
                dims, e.g. layers). Computed in fp32, returned in ``keys.dtype``.
            positions: ``[num_tokens]`` absolute positions (tokens).
            tables: ``cos_sin(positions)`` computed once by the caller, for callers that
                rotate the same positions many times (one layer at a time); on
                ``keys.device``.

        Returns:
            Rotated keys, same shape, dtype and device as ``keys``.

        Raises:
            ValueError: ``keys``, ``positions`` and ``tables`` disagree on the number of tokens.
        """
        return self._apply(keys, positions, inverse=False, tables=tables)

    def unrotate(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Recover pre-RoPE keys from keys rotated at ``positions`` (inverse of :meth:`rotate`)."""
        return self._apply(keys, positions, inverse=True)
