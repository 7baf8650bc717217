"""Capture on a miss: keep the KV a request's own prefill computed for memories it served as text.

A memory whose KV is not in the pool (not encoded yet, evicted, Redis down) is placed in
the prompt as text and prefilled by vLLM like any prompt token. Its K and V then sit in
vLLM's paged cache; this module reads them back out, so the next request injects them and
no encoder runs (docs/decisions.md, "A miss pays once"). Pure functions and small
classes, no vLLM import: the connector (:mod:`inferscale.serving.connector`) wires them.

The request names what to keep in its ``kv_transfer_params`` (the front writes it,
:meth:`CaptureRequest.to_params`)::

    {"inferscale": {..., "capture": {"parts": {"fmt": 2, "fp": "...", "dtype": "float32"},
                                     "storage": "auto", "disk_budget_bytes": null,
                                     "spans": [["<fact id>", 412, 18, "<token digest>"], ...]}}}

Each span is ``[owner, start position, num tokens, digest of the memory line's tokens]``.
A span is kept only when the prompt's own tokens there have that digest (a chat template
that rendered the memory otherwise keeps nothing), under :func:`captured_key` of the
owner, the ``parts`` and the digest; the front finds it by computing the same key from the
memory's text. A span may name its pool key as a fifth element instead: an encode
(:mod:`inferscale.kv.engine_encoder`) is a prefill-only request whose one span is the fact's
line after its Context-Window Encoding context, kept under the fact's encoded key.

Reading vLLM's paged cache back: its layout is the attention backend's own (on the CPU a
block is ``[num_kv_heads, 2 * block_size, head_size]``, keys transposed in fp32 and tiled
for AMX in bf16; on CUDA ``[2, num_blocks, block_size, num_kv_heads, head_size]``), and
vLLM offers a writer (``do_kv_cache_update``) but no reader. :meth:`CacheLayout.calibrate`
learns the layout from the writer itself: it writes token/head/channel indices, as small
integers exact in any float dtype, into a scratch copy of two blocks and reads where each
landed, then checks the map with random KV. A cache whose layout does not round-trip (an
fp8 cache with scales) gets no layout, and capture is off for it (one log line).
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from inferscale.kv.pool import kv_key, validate_key

#: ``kv_transfer_params["inferscale"]`` field holding a :class:`CaptureRequest`.
CAPTURE_FIELD = "capture"

#: The part of a captured entry's key that sets it apart from encoded KV of the same tokens.
CAPTURED = "captured"


def token_digest(ids: Sequence[int]) -> str:
    """A 24-hex-digit digest of token ids (the part of a KV key that names its tokens)."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:24]


def captured_key(owner: str, parts: dict[str, Any], digest: str) -> str:
    """The pool key of ``owner``'s captured KV over the tokens whose :func:`token_digest` is ``digest``.

    Args:
        owner: the memory's id. parts: what else the KV depends on (KV format, model
            fingerprint, dtype, storage dtype: :meth:`inferscale.kv.manager.KVManager.capture_parts`).

    Raises:
        ValueError: a malformed owner id.
    """
    return kv_key(owner, **parts, variant=CAPTURED, span=digest)


@dataclass(frozen=True)
class CaptureRequest:
    """What a request asks the connector to keep from its prefill.

    Attributes:
        parts: key parts (:func:`captured_key`). storage: ``kv_storage_dtype`` (``"auto"``,
            ``"int8"`` or ``"int4"``) the KV is stored in.
        disk_budget_bytes: the front's disk budget for the pool's folder (``None``: none),
            which the connector's writes keep to as the front's own writes do.
        spans: ``(owner, start, num_tokens, token digest)`` of each memory line served as
            text (positions in tokens), or ``(owner, start, num_tokens, token digest, key)``
            to keep it under ``key`` (an encode) rather than :func:`captured_key`.
    """

    parts: dict[str, Any]
    storage: str
    disk_budget_bytes: int | None
    spans: tuple[tuple, ...]

    def to_params(self) -> dict:
        return {"parts": dict(self.parts), "storage": self.storage, "disk_budget_bytes": self.disk_budget_bytes,
                "spans": [list(s) for s in self.spans]}

    @classmethod
    def from_params(cls, entry: Any) -> "CaptureRequest | None":
        """Parse the ``capture`` field (``None`` when absent).

        Raises:
            ValueError: a malformed field.
        """
        if entry is None:
            return None
        from inferscale.kv.quant import STORAGE_DTYPES

        if not isinstance(entry, dict) or not isinstance(entry.get("parts"), dict):
            raise ValueError("capture must be a dict with 'parts', 'storage', 'disk_budget_bytes' and 'spans'")
        parts = entry["parts"]
        if not all(isinstance(k, str) and isinstance(v, (str, int)) and not isinstance(v, bool)
                   for k, v in parts.items()):
            raise ValueError("capture parts must map names to strings or integers")
        storage = entry.get("storage")
        if storage not in STORAGE_DTYPES:
            raise ValueError(f"capture storage must be one of {', '.join(STORAGE_DTYPES)}, got {storage!r}")
        budget = entry.get("disk_budget_bytes")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"capture disk_budget_bytes must be a positive integer or null, got {budget!r}")
        spans = []
        for span in entry.get("spans") or ():
            if not (isinstance(span, (list, tuple)) and len(span) in (4, 5) and isinstance(span[0], str)
                    and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in span[1:3])
                    and span[2] > 0 and isinstance(span[3], str)):
                raise ValueError(f"capture span {span!r} is not [owner, start, num_tokens, token digest(, key)]")
            kv_key(span[0])  # a well-formed owner id
            if len(span) == 5:
                if not (isinstance(span[4], str) and validate_key(span[4]).split("/", 1)[0] == span[0]):
                    raise ValueError(f"capture span {span!r}: its key must be a pool key of its owner {span[0]!r}")
                spans.append((span[0], span[1], span[2], span[3], span[4]))
            else:
                spans.append((span[0], span[1], span[2], span[3]))
        return cls(dict(parts), storage, budget, tuple(spans))


@dataclass(frozen=True)
class CaptureSpan:
    """One span to read out of the paged cache once its tokens are computed.

    Attributes:
        key: its pool key (:func:`captured_key`). start: first prompt position (tokens).
        token_ids: the prompt's tokens at the span.
    """

    key: str
    start: int
    token_ids: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


def plan_captures(request: CaptureRequest, prompt: Sequence[int]) -> tuple[list[CaptureSpan], int]:
    """The spans of ``request`` whose tokens are the prompt's own tokens at their positions.

    Returns:
        The spans to capture, and how many were left out (past the prompt, or other tokens there).
    """
    out, skipped = [], 0
    for owner, start, n, digest, *key in request.spans:
        ids = tuple(int(t) for t in prompt[start:start + n])
        if len(ids) != n or token_digest(ids) != digest:
            skipped += 1
            continue
        out.append(CaptureSpan(key[0] if key else captured_key(owner, request.parts, digest), start, ids))
    return out, skipped


#: ``write(keys, values, cache, slots)``: the attention backend's own writer into ``cache``,
#: with keys/values ``[N, num_kv_heads, head_size]`` and slots ``[N]`` int64.
CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class LayoutError(RuntimeError):
    """The paged cache's layout could not be learned from its writer (the cache stores
    something other than the K and V it is given: an fp8 cache with scales)."""


@dataclass(frozen=True)
class CacheLayout:
    """Where each token's K and V sit inside one block of a layer's paged cache.

    Attributes:
        block_dim: the cache tensor's block dimension.
        block_size: tokens per block.
        k_index: ``[block_size, num_kv_heads, head_size]`` int64 offsets of each key element
            in a block's storage (the block's elements in the cache's dimension order, block
            dimension removed); v_index: likewise for values.
    """

    block_dim: int
    block_size: int
    k_index: torch.Tensor
    v_index: torch.Tensor

    @classmethod
    def calibrate(cls, cache: torch.Tensor, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                  write: CacheWriter) -> "CacheLayout":
        """Learn the layout of ``cache`` from ``write`` (see the module docstring).

        Args:
            cache: one layer's paged cache (any layout that holds ``num_blocks`` blocks along
                one dimension); it is not written (a two-block copy is).
            num_blocks: blocks in the cache. block_size: tokens per block.
            num_kv_heads, head_size: the layer's K/V shape per token.
            write: the backend's writer (:data:`CacheWriter`).

        Raises:
            LayoutError: no dimension has ``num_blocks`` blocks, or the learned map does not
                give back random KV written through ``write``.
        """
        dims = [d for d, size in enumerate(cache.shape) if size == num_blocks]
        if not dims:
            raise LayoutError(f"no dimension of the cache {tuple(cache.shape)} holds its {num_blocks} blocks")
        block_dim = dims[0]
        scratch = cache.narrow(block_dim, 0, 2).clone()
        slots = torch.arange(block_size, 2 * block_size, device=cache.device)  # block 1 of the copy
        shape = (block_size, num_kv_heads, head_size)
        n = math.prod(shape)
        base = 32  # digits 1..32: integers exact in fp32, fp16 and bf16 alike
        digits = max(1, math.ceil(math.log(n, base)))
        index = torch.arange(n, device=cache.device).view(shape)
        zeros = torch.zeros(shape, dtype=cache.dtype, device=cache.device)
        maps = []
        for which in (0, 1):  # keys, then values
            found = None
            for p in range(digits):
                coded = ((index // base ** p) % base + 1).to(cache.dtype)
                scratch.zero_()
                write(coded if which == 0 else zeros, zeros if which == 0 else coded, scratch, slots)
                flat = scratch.select(block_dim, 1).reshape(-1).float()
                where = flat.nonzero().view(-1)
                if where.numel() != n:
                    raise LayoutError(f"writing {n} elements changed {where.numel()} of the cache's block")
                if found is None:
                    found, acc = where, torch.zeros(n, dtype=torch.long, device=cache.device)
                elif not torch.equal(where, found):
                    raise LayoutError("the cache's writer puts the same elements in different places")
                acc += (flat[where].round().long() - 1) * base ** p
            offsets = torch.full((n,), -1, dtype=torch.long, device=cache.device)
            if acc.min() < 0 or acc.max() >= n:
                raise LayoutError("the cache's writer changed the values it was given")
            offsets[acc] = found
            if (offsets < 0).any():
                raise LayoutError("the cache's writer wrote some elements twice")
            maps.append(offsets.view(shape))
        layout = cls(block_dim, block_size, maps[0], maps[1])
        keys = torch.randn(shape, device=cache.device).to(cache.dtype)
        values = torch.randn(shape, device=cache.device).to(cache.dtype)
        scratch.zero_()
        write(keys, values, scratch, slots)
        k, v = layout.read(scratch, [0, 1], torch.arange(block_size, 2 * block_size))
        if not (torch.equal(k, keys) and torch.equal(v, values)):
            raise LayoutError("KV read back through the learned layout differs from what was written")
        return layout

    def read(self, cache: torch.Tensor, block_ids: Sequence[int],
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of prompt ``positions`` of a request whose blocks are ``block_ids``.

        Args:
            cache: the layer's paged cache. block_ids: the request's blocks in prompt order.
            positions: ``[N]`` int64 prompt positions (tokens).

        Returns:
            Two ``[N, num_kv_heads, head_size]`` tensors (copies) in the cache's dtype, on its device.
        """
        k, v = self.gather_index(tuple(cache.shape), block_ids, positions)
        return cache.take(k), cache.take(v)

    def gather_index(self, shape: tuple[int, ...], block_ids: Sequence[int],
                     positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the K and V elements of prompt ``positions`` sit in a cache of ``shape``: two
        ``[N, num_kv_heads, head_size]`` int64 tensors of indices into the cache viewed as
        1-D (``torch.take``), on the layout's device. Every layer of one shape shares them,
        so a capture computes them once and reads each layer with two gathers.

        Raises:
            IndexError: a position beyond the request's blocks.
        """
        device = self.k_index.device
        pos = positions.to(torch.long).cpu()
        blocks = torch.as_tensor(list(block_ids), dtype=torch.long)[pos // self.block_size].to(device)
        offset = (pos % self.block_size).to(device)
        rest, block_stride = _block_offsets(shape, self.block_dim, device)
        base = (blocks * block_stride)[:, None, None]
        return base + rest[self.k_index[offset]], base + rest[self.v_index[offset]]


@functools.lru_cache(maxsize=8)  # one per cache shape: a model's layers share one or two
def _block_offsets(shape: tuple[int, ...], block_dim: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """For a tensor of ``shape`` viewed as 1-D: the index of each element of block 0, in the
    block's own element order (the other dimensions, in order), and the distance between two
    blocks (elements). Cached: every capture of the engine's life reads the same shapes."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    rest_shape = [n for i, n in enumerate(shape) if i != block_dim]
    rest_strides = [st for i, st in enumerate(strides) if i != block_dim]
    flat = torch.arange(math.prod(rest_shape), device=device)
    out = torch.zeros_like(flat)
    for n, st in zip(reversed(rest_shape), reversed(rest_strides)):
        out += (flat % n) * st
        flat = flat // n
    return out, strides[block_dim]
