"""The transformers reference path: the same prompt, the same injected KV, no vLLM.

It is the test oracle for the connector, and where teacher-forced answer likelihoods
come from (vLLM skips KV connectors for ``prompt_logprobs`` requests). Injected segments
are rotated to their prompt positions with the same :class:`RopeRotator` and placed in a
transformers ``DynamicCache``; the model then runs only the tokens after them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from inferscale.kv.encoder import KVEncoder
from inferscale.kv.pool import StoredKV


class ReferenceModel:
    """Runs prompts on the encoder's transformers model, optionally with injected KV.

    Args:
        encoder: supplies the model, its device and its rotator.
    """

    def __init__(self, encoder: KVEncoder) -> None:
        self.model = encoder.model
        self.rotator = encoder.rotator
        self.device = encoder.device

    def _prefix_cache(self, segments: Sequence[tuple[int, StoredKV]]):
        from transformers import DynamicCache

        pos = 0
        keys, values = [], []
        for start, kv in segments:
            if start != pos:
                raise ValueError(f"injected segments must be contiguous from 0; got one at {start}, expected {pos}")
            positions = torch.arange(start, start + kv.num_tokens, device=self.device)
            keys.append(self.rotator.rotate(kv.keys.to(self.device), positions))
            values.append(kv.values.to(self.device))
            pos += kv.num_tokens
        cache = DynamicCache(config=self.model.config)
        k_all = torch.cat(keys, dim=1)  # [L, N, H, D]
        v_all = torch.cat(values, dim=1)
        for layer in range(k_all.shape[0]):
            # DynamicCache wants [batch, num_kv_heads, tokens, head_dim]
            cache.update(k_all[layer].transpose(0, 1)[None], v_all[layer].transpose(0, 1)[None], layer)
        return cache, pos

    @torch.no_grad()
    def logits(self, token_ids: Sequence[int], segments: Sequence[tuple[int, StoredKV]] = ()) -> torch.Tensor:
        """Logits for every position after the injected prefix.

        Args:
            token_ids: the whole prompt (tokens).
            segments: ``(start, FactKV or QuantizedKV)`` pairs covering a prefix ``[0, n)`` of the prompt;
                empty for a plain full prefill.

        Returns:
            ``[len(token_ids) - n, vocab]`` float32 logits (position ``i`` predicts token ``n + i + 1``).
        """
        ids = torch.tensor([list(token_ids)], device=self.device)
        if not segments:
            return self.model(input_ids=ids).logits[0].float()
        cache, n = self._prefix_cache(segments)
        if n >= len(token_ids):
            raise ValueError("the injected prefix covers the whole prompt; leave at least one token to run")
        rest = ids[:, n:]
        positions = torch.arange(n, len(token_ids), device=self.device)[None]
        out = self.model(input_ids=rest, past_key_values=cache, position_ids=positions, cache_position=positions[0])
        return out.logits[0].float()

    def next_token_logprobs(self, token_ids: Sequence[int], segments: Sequence[tuple[int, StoredKV]] = ()) -> torch.Tensor:
        """Log-probabilities ``[vocab]`` of the token after the prompt."""
        return torch.log_softmax(self.logits(token_ids, segments)[-1], dim=-1)

    def answer_nll(
        self, prompt_ids: Sequence[int], answer_ids: Sequence[int], segments: Sequence[tuple[int, StoredKV]] = ()
    ) -> float:
        """Teacher-forced mean negative log-likelihood of ``answer_ids`` after the prompt (nats per token).

        Raises:
            ValueError: ``answer_ids`` is empty.
        """
        if not answer_ids:
            raise ValueError("answer_ids is empty: give at least one answer token")
        full = list(prompt_ids) + list(answer_ids)
        logits = self.logits(full, segments)
        n = len(full) - logits.shape[0]  # tokens covered by the injected prefix
        # logits[i] predicts full[n + i + 1]; the answer starts at len(prompt_ids)
        first = len(prompt_ids) - n - 1
        pred = torch.log_softmax(logits[first : first + len(answer_ids)], dim=-1)
        target = torch.tensor(list(answer_ids), device=pred.device)
        return float(-pred.gather(1, target[:, None]).mean())
