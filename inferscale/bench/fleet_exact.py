"""The fleet simulator's exact engine: LRU reference by reference, on a drawn request trace.

:func:`simulate_lru` is the ground truth the analytic engine
(:class:`inferscale.bench.fleet.Analytic`, Che's approximation) is checked against:
:func:`validate` runs both on one workload. Python-speed (about 5 us a reference on a
loaded 2-core EPYC, one cache per distinct stack depth), so for traces of up to ~10^7
references: fleets of ~10^4 users.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from inferscale.bench.fleet import TIER_NAMES, Analytic, EncodeCost, KVShape, Served, Workload, analytic_served


def simulate_lru(refs: Sequence[int], sizes: Sequence[float], depths: Sequence[float], *,
                 tokens: Sequence[float] | None = None, warmup: int = 0,
                 tiers: Sequence[str] | None = None, admit_window: int | None = None) -> Served:
    """Exact LRU, reference by reference: the tier each reference is served from.

    One byte-budgeted LRU (``OrderedDict``, least recently used out first; an item larger
    than the budget is not kept, as :class:`~inferscale.kv.tiers.MemoryTier` does) per
    stack depth. LRU's inclusion property makes a deeper cache hold all a shallower one
    does, so a reference is served by the first tier whose depth's cache holds it.

    Args:
        refs: item ids in reference order (ints in ``0..len(sizes)-1``).
        sizes: bytes per item.
        depths: bytes of stack each tier reaches, non-decreasing (:meth:`Tiers.depths`).
        tokens: tokens per item that weigh each reference (default 1 each: a hit rate by count).
        warmup: references that warm the caches and are not counted.
        tiers: names per depth (default ``tier0, tier1, ...``).
        admit_window: admission on a second use (``kv_admission_window_s`` counted in
            references): a miss that would evict is kept only when the same item missed within
            that many references before (one that fits is kept); ``None`` keeps every miss.

    Returns:
        Shares of the counted references' tokens per tier, the miss share and the stored
        share (tokens of misses kept).

    Raises:
        ValueError: depths that decrease or are negative, an unknown item, a warmup not
            shorter than the trace, tokens or names of another length.
    """
    depths = [float(d) for d in depths]
    if any(d < 0 for d in depths) or any(b < a for a, b in zip(depths, depths[1:])):
        raise ValueError(f"depths must be non-negative and non-decreasing bytes, got {depths}")
    refs = np.asarray(refs, dtype=np.int64)
    sizes_list = [float(s) for s in sizes]
    if refs.size and (int(refs.min()) < 0 or int(refs.max()) >= len(sizes_list)):
        raise ValueError(f"refs must be item ids in 0..{len(sizes_list) - 1}")
    if not 0 <= warmup < refs.size:
        raise ValueError(f"warmup ({warmup}) must be >= 0 and shorter than the trace ({refs.size} references)")
    weight = [1.0] * len(sizes_list) if tokens is None else [float(t) for t in tokens]
    names = tuple(tiers) if tiers is not None else tuple(f"tier{i}" for i in range(len(depths)))
    if len(weight) != len(sizes_list) or len(names) != len(depths):
        raise ValueError(f"tokens must give one count per item ({len(sizes_list)}) and tiers one name per depth "
                         f"({len(depths)}), got {len(weight)} and {len(names)}")
    caps = sorted(set(depths))
    serves = [depths.index(cap) for cap in caps]  # the first tier reaching a depth serves what it holds
    caches = [_LRU(cap, sizes_list) for cap in caps]
    deepest = len(caps) - 1
    served = [0.0] * (len(depths) + 1)
    stored = 0.0
    missed: dict[int, int] = {}  # item -> the reference of its last miss that was not kept
    for start in range(0, refs.size, 1 << 20):
        for pos, item in enumerate(refs[start:start + (1 << 20)].tolist(), start):
            where = len(depths)
            for c in range(deepest, -1, -1):
                if not caches[c].touch(item):
                    full = caches[c].used + sizes_list[item] > caches[c].budget
                    if c == deepest and admit_window is not None and full:  # a miss that would evict:
                        last = missed.pop(item, None)  # kept on its second use within the window only
                        if last is None or pos - last > admit_window:
                            missed[item] = pos
                            break
                    if c == deepest and pos >= warmup:
                        stored += weight[item]
                    for shallower in caches[:c + 1]:  # inclusion: in none of the shallower either
                        shallower.add(item)
                    break
                where = serves[c]
            if pos >= warmup:
                served[where] += weight[item]
    total = sum(served)
    return Served(names, tuple(s / total for s in served[:-1]), served[-1] / total, stored / total)


class _LRU:
    """Items under a byte budget, least recently used out first (as MemoryTier keeps KV)."""

    def __init__(self, budget: float, sizes: list[float]) -> None:
        self.budget, self.sizes, self.used = budget, sizes, 0.0
        self.items: OrderedDict[int, None] = OrderedDict()

    def touch(self, item: int) -> bool:
        """Mark ``item`` most recently used; ``False`` when it is not held."""
        try:
            self.items.move_to_end(item)
        except KeyError:
            return False
        return True

    def add(self, item: int) -> None:
        """Hold ``item`` (not at all when it alone is over the budget), evicting the least recently used."""
        size = self.sizes[item]
        if size > self.budget:
            return
        self.items[item] = None
        self.used += size
        while self.used > self.budget:
            old, _ = self.items.popitem(last=False)
            self.used -= self.sizes[old]


@dataclass(frozen=True)
class Trace:
    """A request trace of a workload, for :func:`simulate_lru`.

    Attributes:
        refs: ``[references]`` int64 fact ids, request after request.
        requests: requests in the trace.
        first_fact: ``[users + 1]`` int64: user u's facts are ids ``first_fact[u]..first_fact[u+1]-1``,
            most retrieved first.
    """

    refs: np.ndarray
    requests: int
    first_fact: np.ndarray

    @property
    def num_facts(self) -> int:
        return int(self.first_fact[-1])


def request_trace(workload: Workload, requests: int, *, seed: int = 1, chunk: int = 4096) -> Trace:
    """Draw ``requests`` requests: a user by its Zipf share, then each of its facts with its
    inclusion probability (:meth:`Workload.inclusion`). Memory counts per user are the
    workload's draw, as :class:`Analytic` uses.

    Raises:
        ValueError: ``requests`` < 1.
    """
    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(workload.user_shares())
    classes = workload.user_classes()
    counts = np.asarray(workload.memory_counts)[classes]
    first_fact = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    pis = [workload.inclusion(c) for c in workload.memory_counts]
    out = []
    for start in range(0, requests, chunk):
        n = min(chunk, requests - start)
        users = np.minimum(np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right"), workload.users - 1)
        pos_parts, id_parts = [], []
        for c, pi in enumerate(pis):
            rows = np.flatnonzero(classes[users] == c)
            if rows.size == 0:
                continue
            r, j = np.nonzero(rng.random((rows.size, pi.size)) < pi)
            pos_parts.append(rows[r])
            id_parts.append(first_fact[users[rows[r]]] + j)
        pos, ids = np.concatenate(pos_parts), np.concatenate(id_parts)
        out.append(ids[np.argsort(pos, kind="stable")])
    return Trace(np.concatenate(out), requests, first_fact)


@dataclass(frozen=True)
class Validation:
    """The analytic engine against the exact one on one trace.

    Attributes:
        users, requests, references, warmup: the trace (warmup references not counted).
        depth_shares: stack depths compared, as shares of the footprint (device, +host, disk).
        depths_bytes: the same in bytes.
        tokens_range: the least and most tokens a fact was given.
        exact, analytic: shares per tier and misses.
        max_gap: largest absolute difference of a tier's share or the KV share (0-1).
    """

    users: int
    requests: int
    references: int
    warmup: int
    depth_shares: tuple[float, ...]
    depths_bytes: tuple[float, ...]
    tokens_range: tuple[int, int]
    exact: Served
    analytic: Served
    max_gap: float


def validate(workload: Workload, *, depth_shares: Sequence[float] = (0.05, 0.2, 0.65), requests: int = 200_000,
             warmup_share: float = 2 / 3, token_spread: int | None = None, dtype: str = "bfloat16",
             shape: KVShape = KVShape(), seed: int = 1) -> Validation:
    """Run both engines on one workload: a drawn trace through :func:`simulate_lru` and :class:`Analytic`.

    Each fact gets a token count drawn uniformly in ``tokens_per_fact +- token_spread``
    (rounded; default 13, less for short facts; LoCoMo's fact lines span 17-50 tokens),
    so the exact run weighs bytes and tokens per fact while the analytic one uses the
    mean: the comparison also checks that the mean is all that matters.

    Args:
        depth_shares: stack depths as shares of the footprint (device, +host, disk).
        requests: requests drawn; the first ``warmup_share`` of the references are not counted.

    Raises:
        ValueError: bad shares or spread.
    """
    if not all(0 < s <= 1 for s in depth_shares) or list(depth_shares) != sorted(depth_shares):
        raise ValueError(f"depth_shares must be non-decreasing shares in (0, 1], got {list(depth_shares)}")
    if not 0 <= warmup_share < 1:
        raise ValueError(f"warmup_share must be in [0, 1), got {warmup_share}")
    trace = request_trace(workload, requests, seed=seed)
    tokens = _draw_tokens(workload, trace, token_spread, seed + 1)
    sizes = shape.fact_bytes(tokens, dtype)
    footprint = float(sizes.sum())
    depths = tuple(s * footprint for s in depth_shares)
    names = TIER_NAMES[: len(depths)]
    warmup = int(len(trace.refs) * warmup_share)
    exact = simulate_lru(trace.refs, sizes, depths, tokens=tokens, warmup=warmup, tiers=names)
    model = Analytic(Workload(**{**asdict(workload), "tokens_per_fact": float(tokens.mean())}))
    analytic = analytic_served(model, depths, footprint / trace.num_facts, names)
    gap = max([abs(a - b) for a, b in zip(exact.shares, analytic.shares)] + [abs(exact.kv_share - analytic.kv_share)])
    return Validation(workload.users, requests, len(trace.refs), warmup, tuple(depth_shares), depths,
                      (int(tokens.min()), int(tokens.max())), exact, analytic, gap)


def _draw_tokens(workload: Workload, trace: Trace, token_spread: int | None, seed: int) -> np.ndarray:
    """``[facts]`` int64 tokens per fact, uniform in ``tokens_per_fact +- token_spread``
    (default 13, less for short facts).

    Raises:
        ValueError: a spread outside ``[0, tokens_per_fact)``.
    """
    mean_tokens = max(1, round(workload.tokens_per_fact))
    token_spread = min(13, mean_tokens - 1) if token_spread is None else token_spread
    if not 0 <= token_spread < mean_tokens:
        raise ValueError(f"token_spread must be in [0, {mean_tokens}), got {token_spread}")
    rng = np.random.default_rng(seed)
    return rng.integers(mean_tokens - token_spread, mean_tokens + token_spread + 1, size=trace.num_facts)


#: admission windows compared by :func:`admission_study` (hours; ``None``: every miss kept)
ADMISSION_HOURS = (None, 1.0, 24.0, 96.0)


def admission_study(workload: Workload, depths: Sequence[float], *, hours: Sequence[float | None] = ADMISSION_HOURS,
                    requests: int = 600_000, warmup_share: float = 2 / 3, dtype: str = "bfloat16",
                    shape: KVShape = KVShape(), cost: EncodeCost = EncodeCost(), seed: int = 3) -> list[dict]:
    """Admission on a second use (``kv_admission_window_s``), replayed exactly on one drawn
    trace per window: a miss that would evict is kept only when the same fact missed within
    the window (one that fits is kept, as :attr:`inferscale.kv.pool.KVPool.under_pressure`
    has it). Time is the trace's: ``workload.requests_per_hour``.

    Args:
        depths: the tiers' stack depths in bytes (:meth:`Tiers.depths`).
        hours: windows compared, in hours (``None``: every miss kept).
        requests: requests drawn; the first ``warmup_share`` of the references are not counted.

    Returns:
        One dict per window: ``hours``, ``kv_share`` (retrieved fact tokens served as KV),
        ``stored_share`` (tokens of misses kept, per retrieved token), and GPU seconds per hour
        of the fleet: ``kept_reencode_gpu_s_per_hour`` (if every kept miss were re-encoded:
        ``capture_kv`` off), ``miss_text_gpu_s_per_hour`` (the misses' own text prefill) and
        ``hit_saved_gpu_s_per_hour``.

    Raises:
        ValueError: a window <= 0, a warmup share outside [0, 1).
    """
    if any(h is not None and not h > 0 for h in hours) or not 0 <= warmup_share < 1:
        raise ValueError(f"windows are hours > 0 (or None) and the warmup a share in [0, 1), got {list(hours)}, "
                         f"{warmup_share}")
    trace = request_trace(workload, requests, seed=seed)
    tokens = _draw_tokens(workload, trace, None, seed + 1)
    sizes = shape.fact_bytes(tokens, dtype)
    refs_per_hour = workload.requests_per_hour * len(trace.refs) / trace.requests
    warmup = int(len(trace.refs) * warmup_share)
    counted = trace.refs[warmup:]
    tokens_per_hour = refs_per_hour * float(tokens[counted].mean())
    per_token = cost.seconds_per_token
    miss_tokens = cost.tokens_per_miss(workload.tokens_per_fact) / workload.tokens_per_fact  # re-encode per fact token
    rows = []
    for h in hours:
        served = simulate_lru(trace.refs, sizes, depths, tokens=tokens, warmup=warmup,
                              admit_window=None if h is None else int(h * refs_per_hour))
        rows.append({"hours": h, "kv_share": served.kv_share, "stored_share": served.stored_share,
                     "kept_reencode_gpu_s_per_hour": served.stored_share * tokens_per_hour * miss_tokens * per_token,
                     "miss_text_gpu_s_per_hour": served.miss_share * tokens_per_hour * per_token,
                     "hit_saved_gpu_s_per_hour": served.kv_share * tokens_per_hour * per_token})
    return rows
