"""The injection plan: the wire format between :meth:`inferscale.Memory.inject` and the
KV connector, and the tensor work of an injection, as pure functions (no vLLM).

Wire format (what a request carries in ``kv_transfer_params``)::

    {"inferscale": {"memory_end": 412,
                    "segments": [["_preamble/<hash>", 0, 31], ["<fact_id>/<hash>", 31, 18], ...]}}

``segments`` are ``[pool key, start position, num tokens]`` triples tiling the prompt's
first ``memory_end`` tokens. What the connector injected comes back in the finished
request's ``kv_transfer_params`` as ``{"inferscale_injected_tokens": n}``
(:func:`report_params` / :func:`injected_tokens`), which vLLM carries from the engine
core to the caller in any process layout.

An injection, for one request whose first ``start`` prompt tokens are already computed
(prefix cache) and whose prompt positions live in paged-cache ``block_ids``:

1. :func:`stage` gathers the segments' pre-RoPE K and V from ``start`` to ``memory_end``
   (``[L, N, H, D]``) with the ``N`` prompt positions they are served at;
2. :func:`slot_mapping` maps positions to cache slots
   (``block_ids[pos // block_size] * block_size + pos % block_size``, vLLM's layout);
3. :func:`write_layers` rotates each layer's keys to their positions (cos/sin computed
   once) and hands them, with the values, to that layer's writer (vLLM's
   ``do_kv_cache_update`` in the connector; ``index_copy_`` in tests and benchmarks);
4. when a segment cannot be read, :func:`blocks_to_recompute` names the claimed blocks
   vLLM must recompute, so attention never reads claimed-but-unwritten blocks.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from inferscale.kv.capture import CAPTURE_FIELD, CaptureRequest
from inferscale.kv.pool import StoredKV, validate_key
from inferscale.kv.quant import QuantizedKV, QuantizedRun, dequantize_many
from inferscale.kv.rope import RopeRotator

PARAMS_KEY = "inferscale"
#: the replica index a server reports (:func:`report_params`), and where it reads it
REPLICA_KEY = "inferscale_replica"
REPLICA_ENV = "INFERSCALE_REPLICA"
REPORT_KEY = "inferscale_injected_tokens"


@dataclass(frozen=True)
class PlannedSegment:
    """One span of the memory block supplied from the KV pool.

    Attributes:
        key: pool key ``"<owner>/<32 hex>"`` (:func:`inferscale.kv.pool.kv_key`).
        start: first prompt position (tokens).
        num_tokens: span length (tokens).
    """

    key: str
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class InjectionPlan:
    """What one request asks the connector to inject.

    Attributes:
        memory_end: prompt tokens covered by the segments (tokens).
        segments: contiguous from position 0 to ``memory_end``.
        capture: the memory lines served as text whose KV the connector keeps
            (:mod:`inferscale.kv.capture`; ``None``: none).
    """

    memory_end: int
    segments: tuple[PlannedSegment, ...]
    capture: CaptureRequest | None = None

    def __post_init__(self) -> None:
        pos = 0
        for seg in self.segments:
            validate_key(seg.key)
            if seg.start != pos or seg.num_tokens <= 0:
                raise ValueError(f"segment {seg.key} at {seg.start} (+{seg.num_tokens}) does not continue at "
                                 f"position {pos}")
            pos = seg.end
        if pos != self.memory_end:
            raise ValueError(f"segments cover {pos} tokens but memory_end is {self.memory_end}")

    @classmethod
    def of(cls, segments: Iterable[tuple[str, int, int]], capture: CaptureRequest | None = None) -> "InjectionPlan":
        """Plan from ``(key, start, num_tokens)`` triples; ``memory_end`` is where they stop.

        Raises:
            ValueError: a malformed key, or segments with gaps or overlaps.
        """
        segs = tuple(PlannedSegment(k, s, n) for k, s, n in segments)
        return cls(segs[-1].end if segs else 0, segs, capture)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(s.key for s in self.segments)

    def cache_salt(self, scope_key: str = "") -> str:
        """Prefix-cache salt (:func:`cache_salt`): requests share cached blocks only when they
        carry the same scope's memory and inject exactly the same KV."""
        return cache_salt(scope_key, self)

    def to_params(self) -> dict:
        """The request's ``kv_transfer_params`` (JSON-serialisable)."""
        entry: dict[str, Any] = {"memory_end": self.memory_end,
                                 "segments": [[s.key, s.start, s.num_tokens] for s in self.segments]}
        if self.capture is not None:
            entry[CAPTURE_FIELD] = self.capture.to_params()
        return {PARAMS_KEY: entry}

    @classmethod
    def from_params(cls, params: Any) -> "InjectionPlan | None":
        """Parse and validate ``kv_transfer_params``; ``None`` when they carry no InferScale entry.

        Raises:
            ValueError: the entry is malformed (bad key or count, gaps or overlaps between segments).
        """
        if not isinstance(params, dict) or PARAMS_KEY not in params:
            return None
        entry = params[PARAMS_KEY]
        try:
            if not isinstance(entry, dict):
                raise TypeError(f"expected a dict, got {type(entry).__name__}")
            segments = tuple(PlannedSegment(validate_key(k), _count(s), _count(n)) for k, s, n in entry["segments"])
            return cls(_count(entry["memory_end"]), segments)
        except Exception as exc:  # anything malformed must be rejected, never crash the engine
            raise ValueError(f"malformed kv_transfer_params[{PARAMS_KEY!r}]: {exc}") from exc



def cache_salt(scope_key: str, plan: "InjectionPlan | None") -> str:
    """vLLM's prefix-cache salt (``cache_salt``, mixed into the hash of a prompt's first block and
    so of every block after it) for a request that carries ``scope_key``'s memory, as KV or as text.

    Requests share cached blocks only when they name the same scope and inject exactly the same
    KV: another scope's request never gets one of this scope's blocks, whatever their tokens
    (``usage.prompt_tokens_details.cached_tokens`` would tell a caller that another scope's
    memory equals a guess), and a text request of a scope never reuses blocks its injected
    requests filled. The shared preamble is salted with the scope too: it holds nothing of
    any scope, but a block's hash chains its predecessors', so a salt cannot skip it.

    Args:
        scope_key: the scope's key (:attr:`inferscale.store.records.Scope.key`; ``""`` for a
            request that names none).
        plan: the request's injection plan, ``None`` for a text request.

    Returns:
        32 hex characters (128 bits of SHA-256).
    """
    parts = [scope_key, *(plan.keys if plan is not None else ())]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]

def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


def report_params(injected_tokens: int | None, replica: int | None = None) -> dict | None:
    """What the connector returns from ``request_finished``: ``{"inferscale_injected_tokens": n}``
    for a request that carried InferScale's params, and ``{"inferscale_replica": i}`` from a
    server that knows its replica index (:data:`REPLICA_ENV`); ``None`` when neither."""
    out: dict = {}
    if injected_tokens is not None:
        out[REPORT_KEY] = int(injected_tokens)
    if replica is not None:
        out[REPLICA_KEY] = replica
    return out or None


def replica_index(environ: Any = None) -> int | None:
    """This vLLM server's replica index, from :data:`REPLICA_ENV` (``inferscale serve`` sets it
    for the servers it starts; ``None`` when unset or not a non-negative integer)."""
    import os

    value = (os.environ if environ is None else environ).get(REPLICA_ENV, "")
    return int(value) if value.isdigit() else None


def reported_replica(returned_params: Any) -> int | None:
    """The replica index a finished request's ``kv_transfer_params`` name (``None`` when absent)."""
    if isinstance(returned_params, dict) and type(returned_params.get(REPLICA_KEY)) is int:
        return returned_params[REPLICA_KEY]
    return None


def injected_tokens(returned_params: Any) -> int:
    """Tokens the connector injected, from a finished request's ``kv_transfer_params`` (0 when absent)."""
    if isinstance(returned_params, dict) and isinstance(returned_params.get(REPORT_KEY), int):
        return returned_params[REPORT_KEY]
    return 0


class MissingKVError(LookupError):
    """A planned segment's KV is absent from the pool or has the wrong length."""


@dataclass(frozen=True)
class StagedKV:
    """The KV of one request's injection, gathered and ready to rotate.

    The segments stay as the pool holds them: no ``[num_layers, N, ...]`` copy of the whole
    request is made; :meth:`layer` concatenates one layer's slices (~1.1 MiB in fp32 at
    k=50 for SmolLM2), which stays in cache while it is rotated and written.

    Attributes:
        key_parts: per segment (or run of quantized segments: a
            :class:`~inferscale.kv.quant.QuantizedRun`, dequantized a layer at a time),
            ``[num_layers, n_i, num_kv_heads, head_dim]`` pre-RoPE keys (the ``n_i`` sum to
            ``N``), in prompt order.
        value_parts: same shapes as ``key_parts``.
        positions: ``[N]`` int64 prompt positions, on the parts' device.
    """

    key_parts: tuple[torch.Tensor | QuantizedRun, ...]
    value_parts: tuple[torch.Tensor | QuantizedRun, ...]
    positions: torch.Tensor

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> "StagedKV":
        """One part: ``keys``/``values`` ``[num_layers, N, num_kv_heads, head_dim]``, ``positions`` ``[N]``."""
        return cls((keys,), (values,), positions)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of layer ``index``: two ``[N, num_kv_heads, head_dim]`` tensors."""
        if len(self.key_parts) == 1:
            return self.key_parts[0][index], self.value_parts[0][index]
        return torch.cat([k[index] for k in self.key_parts]), torch.cat([v[index] for v in self.value_parts])

    @property
    def keys(self) -> torch.Tensor:
        """All layers' keys, ``[num_layers, N, num_kv_heads, head_dim]`` (a copy; tests and tools)."""
        return torch.cat([_whole(p) for p in self.key_parts], dim=1)

    @property
    def values(self) -> torch.Tensor:
        """All layers' values, like :attr:`keys`."""
        return torch.cat([_whole(p) for p in self.value_parts], dim=1)


def _whole(part: torch.Tensor | QuantizedRun) -> torch.Tensor:
    return part.full() if isinstance(part, QuantizedRun) else part


def stage(plan: InjectionPlan, start: int, fetch: Callable[[str], StoredKV | None], *,
          batched: bool | None = None, fused: bool | None = None) -> StagedKV | None:
    """Gather the planned KV from prompt position ``start`` (tokens before it are computed).

    Segments may mix storage dtypes: model-dtype KV is taken as it is, 8- and 4-bit KV is
    dequantized here (:mod:`inferscale.kv.quant`), before :func:`write_layers` rotates and
    writes it. How depends on where the pool's tier lives (docs/decisions.md):

    - on the CPU, each run of consecutive quantized segments (one storage dtype) becomes a
      :class:`~inferscale.kv.quant.QuantizedRun`, dequantized a layer at a time inside
      :func:`write_layers` (``fused``), so the float KV of a layer is made, rotated and
      written while it sits in cache; dense segments are taken as they are; the parts stay
      apart and each layer's concatenation stays in cache too;
    - on a GPU, where kernel launches and Python indexing, not bytes, bound this work, the
      quantized segments of each storage dtype are dequantized together
      (:func:`~inferscale.kv.quant.dequantize_many`) and all parts are concatenated once,
      so each layer is a view.

    Args:
        plan: the request's plan.
        start: first position to write (vLLM's ``num_computed_tokens`` when it was claimed).
        fetch: the pool's ``get``.
        batched: the GPU way (``True``) or the CPU way (``False``); ``None``: by the device
            the first segment is on.
        fused: on the CPU way, dequantize a layer at a time (``True``, the default) or each
            segment whole first (``False``: the way before, for comparison).

    Returns:
        A :class:`StagedKV` of ``memory_end - start`` tokens, or ``None`` when nothing is left.

    Raises:
        MissingKVError: a segment is absent or has another length than planned.
    """
    entries: list[tuple[StoredKV, int]] = []  # (stored KV, first token to take), in prompt order
    positions = []
    for seg in plan.segments:
        if seg.end <= start:
            continue  # already computed (prefix cache)
        kv = fetch(seg.key)
        if kv is None or kv.num_tokens != seg.num_tokens:
            raise MissingKVError(f"KV {seg.key} is not in the pool" if kv is None else
                                 f"KV {seg.key} has {kv.num_tokens} tokens, planned {seg.num_tokens}")
        lo = max(start, seg.start) - seg.start
        entries.append((kv, lo))
        positions.append(torch.arange(seg.start + lo, seg.end))
    if not positions:
        return None
    if batched is None:
        first = entries[0][0]
        batched = (first.k_codes if isinstance(first, QuantizedKV) else first.keys).device.type != "cpu"
    parts_k, parts_v = _runs(entries) if not batched and fused is not False else _gather(entries, batched)
    if batched:
        parts_k, parts_v = [torch.cat(parts_k, dim=1)], [torch.cat(parts_v, dim=1)]
    return StagedKV(tuple(parts_k), tuple(parts_v), torch.cat(positions).to(parts_k[0].device))


def _gather(entries: list[tuple[StoredKV, int]], batched: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per entry, ``[L, n_i, H, D]`` keys and values from its token ``lo``: views of dense KV;
    quantized KV dequantized per entry, or (``batched``) per storage dtype together."""
    parts_k: list[torch.Tensor | None] = [None] * len(entries)
    parts_v: list[torch.Tensor | None] = [None] * len(entries)
    groups: dict[tuple, list[int]] = {}
    for i, (kv, lo) in enumerate(entries):
        if batched and isinstance(kv, QuantizedKV):
            groups.setdefault((kv.dtype, kv.value_group, kv.out_dtype), []).append(i)
            continue
        keys, values = kv.keys, kv.values  # dequantized here when stored in 8 or 4 bits
        parts_k[i], parts_v[i] = (keys[:, lo:], values[:, lo:]) if lo else (keys, values)
    for members in groups.values():
        keys, values = dequantize_many([entries[i] for i in members])  # type: ignore[misc]
        sizes = [entries[i][0].num_tokens - entries[i][1] for i in members]
        for i, k, v in zip(members, keys.split(sizes, dim=1), values.split(sizes, dim=1)):
            parts_k[i], parts_v[i] = k, v
    return parts_k, parts_v  # type: ignore[return-value]


def _runs(entries: list[tuple[StoredKV, int]]) -> tuple[list, list]:
    """The CPU's parts: dense entries as views, each run of consecutive quantized entries of
    one storage dtype as one :class:`~inferscale.kv.quant.QuantizedRun` (keys and values)."""
    parts_k: list = []
    parts_v: list = []
    run: list[tuple[QuantizedKV, int]] = []

    def close() -> None:
        if run:
            parts_k.append(QuantizedRun(list(run), values=False))
            parts_v.append(QuantizedRun(list(run), values=True))
            run.clear()
    for kv, lo in entries:
        if isinstance(kv, QuantizedKV):
            if run and (kv.dtype, kv.value_group, kv.out_dtype) != (run[0][0].dtype, run[0][0].value_group,
                                                                    run[0][0].out_dtype):
                close()
            run.append((kv, lo))
            continue
        close()
        keys, values = kv.keys, kv.values
        parts_k.append(keys[:, lo:] if lo else keys)
        parts_v.append(values[:, lo:] if lo else values)
    close()
    return parts_k, parts_v


def slot_mapping(positions: torch.Tensor, block_ids: Sequence[int], block_size: int) -> torch.Tensor:
    """Paged-cache slot of each prompt position: ``block_ids[pos // block_size] * block_size + pos % block_size``.

    Args:
        positions: ``[N]`` int64 prompt positions (tokens).
        block_ids: the request's block ids, in prompt order.
        block_size: tokens per block.

    Returns:
        ``[N]`` int64 slots, on the CPU.

    Raises:
        ValueError: a position falls past the request's last block.
    """
    pos = positions.cpu()
    if pos.numel() and int(pos.max()) // block_size >= len(block_ids):
        raise ValueError(f"position {int(pos.max())} is past the request's {len(block_ids)} blocks of {block_size}")
    blocks = torch.tensor(list(block_ids), dtype=torch.long)
    return blocks[pos // block_size] * block_size + pos % block_size


def blocks_to_recompute(start: int, memory_end: int, block_ids: Sequence[int], block_size: int) -> list[int]:
    """The claimed blocks covering positions ``[start, memory_end)``: reported to vLLM when a load fails."""
    first, last = start // block_size, (memory_end - 1) // block_size
    return list(block_ids[first : last + 1])


@dataclass(frozen=True)
class LayerWriter:
    """Where one attention layer's injected KV goes.

    Attributes:
        layer: index into the staged KV's first dimension.
        device: the layer's cache device; dtype: its cache dtype.
        write: ``write(keys, values, slots)`` with keys/values ``[N, H, D]`` (rotated keys,
            on ``device`` in ``dtype``) and slots ``[N]`` int64 on ``device``.
    """

    layer: int
    device: torch.device
    dtype: torch.dtype
    write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def write_layers(staged: StagedKV, slots: torch.Tensor, rotator: RopeRotator, writers: Iterable[LayerWriter]) -> None:
    """Rotate each layer's keys to their positions and write them, with the values, one layer at a time.

    cos/sin are computed once per call; one layer's rotated keys (``[N, H, D]``, ~1.1 MiB
    in fp32 at k=50 for SmolLM2) stay in cache between rotation and write, instead of a
    rotated copy of every layer going through memory first (docs/decisions.md).

    Args:
        staged: from :func:`stage`. slots: from :func:`slot_mapping` (any device).
        rotator: the served model's rotary embedding. writers: one per attention layer.
    """
    tables = rotator.cos_sin(staged.positions)
    slots_on: dict[torch.device, torch.Tensor] = {}
    for w in writers:
        layer_slots = slots_on.get(w.device)
        if layer_slots is None:
            layer_slots = slots_on[w.device] = slots.to(w.device)
        keys, values = staged.layer(w.layer)
        keys = rotator.rotate(keys, staged.positions, tables)
        w.write(keys.to(w.device, w.dtype), values.to(w.device, w.dtype), layer_slots)
