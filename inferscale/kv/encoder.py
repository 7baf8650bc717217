"""Pre-RoPE KV of token spans, computed with the served model's own weights.

Context-Window Encoding: a fact's tokens are run after a context (the prompt preamble
and the w conversation turns that preceded the fact's source turn); only the fact's own
KV is kept. The keys come out of the model's cache already rotated at the positions
they were encoded at, so they are un-rotated (:meth:`RopeRotator.unrotate`) into
pre-RoPE keys; values carry no position.

Batching: items are sorted by length and right-padded into batches of at most
``batch_tokens`` tokens. Right padding needs no attention mask: under causal attention
a real token never attends to the padding after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from inferscale.runtime.devices import best_device, torch_dtype
from inferscale.kv.pool import FactKV
from inferscale.models.resolve import MODEL_LOADS
from inferscale.kv.rope import RopeRotator

@dataclass(frozen=True)
class EncodeItem:
    """One span to encode.

    Attributes:
        context_ids: token ids run before the span (their KV is discarded).
        span_ids: token ids whose KV is kept (at least one).
        position_offset: absolute position of ``context_ids[0]`` (tokens). Pre-RoPE KV does
            not depend on it mathematically; tests use it to prove that.
    """

    context_ids: tuple[int, ...]
    span_ids: tuple[int, ...]
    position_offset: int = 0


class KVEncoder:
    """Computes pre-RoPE K and V of token spans with a transformers causal LM.

    Args:
        model_path: local Hugging Face folder of the served model.
        dtype: ``"float32"`` or ``"bfloat16"``; KV comes out in this dtype.
        device: where the model runs; default :func:`best_device`.
        batch_tokens: padded tokens per forward pass.

    Attributes:
        model: the loaded ``AutoModelForCausalLM`` (shared with the reference path).
        rotator: the model's :class:`RopeRotator`.
    """

    def __init__(self, model_path: Path, dtype: str, device: torch.device | None = None, batch_tokens: int = 8192):
        from transformers import AutoModelForCausalLM

        self.device = device or best_device()
        self.dtype = torch_dtype(dtype)
        with MODEL_LOADS:  # torch's default dtype is process-wide during the load
            self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=self.dtype).to(self.device).eval()
        self.rotator = RopeRotator(self.model.config)
        self.batch_tokens = batch_tokens

    @torch.no_grad()
    def encode(self, items: Sequence[EncodeItem]) -> list[FactKV]:
        """Encode each item's span; returns one :class:`FactKV` per item, in order.

        Each result is ``[num_layers, len(span_ids), num_kv_heads, head_dim]`` (keys and
        values) on the CPU, in the encoder's dtype.

        Raises:
            ValueError: an item has an empty span, or is longer than the model's context.
        """
        max_len = getattr(self.model.config, "max_position_embeddings", None)
        for it in items:
            if not it.span_ids:
                raise ValueError("cannot encode an empty span: a fact must have at least one token")
            if max_len and it.position_offset + len(it.context_ids) + len(it.span_ids) > max_len:
                raise ValueError(
                    f"span of {len(it.context_ids) + len(it.span_ids)} tokens at offset {it.position_offset} "
                    f"exceeds the model's context of {max_len} tokens: use a smaller context window"
                )
        order = sorted(range(len(items)), key=lambda i: len(items[i].context_ids) + len(items[i].span_ids))
        results: list[FactKV | None] = [None] * len(items)
        batch: list[int] = []
        for idx in order:
            length = len(items[idx].context_ids) + len(items[idx].span_ids)
            if batch and length * (len(batch) + 1) > self.batch_tokens:
                self._encode_batch([items[i] for i in batch], batch, results)
                batch = []
            batch.append(idx)
        if batch:
            self._encode_batch([items[i] for i in batch], batch, results)
        return results  # type: ignore[return-value]

    def _encode_batch(self, items: list[EncodeItem], slots: list[int], results: list) -> None:
        lengths = [len(it.context_ids) + len(it.span_ids) for it in items]
        width = max(lengths)
        pad = self.model.config.pad_token_id or 0
        ids = torch.full((len(items), width), pad, dtype=torch.long)
        pos = torch.zeros((len(items), width), dtype=torch.long)
        for row, it in enumerate(items):
            seq = list(it.context_ids) + list(it.span_ids)
            ids[row, : len(seq)] = torch.tensor(seq)
            pos[row] = torch.arange(width) + it.position_offset
        out = self.model(
            input_ids=ids.to(self.device), position_ids=pos.to(self.device), use_cache=True, logits_to_keep=1
        )
        cache = out.past_key_values
        # per layer: [batch, num_kv_heads, width, head_dim]
        keys = torch.stack([layer.keys for layer in cache.layers])  # [L, B, H, W, D]
        values = torch.stack([layer.values for layer in cache.layers])
        for row, (it, slot) in enumerate(zip(items, slots)):
            start = len(it.context_ids)
            end = start + len(it.span_ids)
            k = keys[:, row, :, start:end, :].transpose(1, 2)  # [L, T, H, D]
            v = values[:, row, :, start:end, :].transpose(1, 2)
            positions = torch.arange(start, end, device=k.device) + it.position_offset
            k_pre = self.rotator.unrotate(k, positions)
            results[slot] = FactKV(k_pre.contiguous().cpu(), v.contiguous().cpu(), tuple(it.span_ids))
