"""A fleet trace simulator: KV bytes per tier, hit rates and re-encode GPU time for 10^4-10^7 users.

No model runs here: sizes and costs are parameters, each with its source below.

The workload (:class:`Workload`)
    Users 1..U ask questions with Zipf(``user_zipf``) popularity: user u makes a share
    ``u^-s / sum_v v^-s`` of the requests. Each user holds the facts of one LoCoMo
    conversation's size (169-324 facts, :data:`LOCOMO_FACT_COUNTS`, drawn per user with a
    seed). A request retrieves ``k`` of its user's facts on average: fact j (the user's
    j-th most retrieved) is in a request with probability ``pi_j = min(1, a w_j)``, ``w_j``
    Zipf(``fact_zipf``) over the user's facts and ``a`` set so that ``sum_j pi_j = k``
    (Poisson sampling: each fact in or out on its own, so a fact's references form a
    Poisson process and both engines below see the same rates).

The tiers (:class:`Tiers`), as :mod:`inferscale.kv.pool` keeps them
    The pool's tiers are LRU under byte budgets; the simulator sees them as cuts of one
    LRU stack ordered by recency, counted in bytes (Mattson's stack view: an LRU of C
    bytes holds the longest most-recent prefix of the stack that fits in C). Device and
    host are **exclusive** (the device tier's evictions go to the host tier, a host hit
    moves up): together they hold the top ``device + host`` bytes. Disk and Redis are
    **inclusive** (every encode is written to disk and through to Redis): disk holds the
    top ``disk`` bytes, Redis the top ``redis`` bytes. So the stack depth a tier reaches
    is ``D_device = device``, ``D_host = D_device + host``, ``D_disk = max(D_host, disk)``,
    ``D_redis = max(D_disk, redis)`` (fleet totals), and a reference served at stack
    depth d comes from the first tier with ``D_t >= d``. Machines partition users
    (consistent hashing by scope, vLLM's router); with many users per machine each machine's LRU has
    the same characteristic time as one LRU of the fleet's total (Che et al. 2002, the
    sum of the machines' equations), so local tiers are summed over machines. Redis's
    own eviction (``allkeys-lfu``) keeps frequent keys better than LRU: LRU is the
    conservative model of it.

Two engines
    - :func:`inferscale.bench.fleet_exact.simulate_lru`: exact, event by event, one
      ``OrderedDict`` per stack depth, evicting least recently used bytes as
      :class:`~inferscale.kv.tiers.MemoryTier` does; for small traces (tests, the check
      on the results page, :func:`inferscale.bench.fleet_exact.validate`).
    - :class:`Analytic` (here): Che's characteristic-time approximation of LRU under the
      independent reference model (Che, Tung and Wang, IEEE JSAC 20(7), 2002; Fricker,
      Robert and Roberts, ITC 2012): the cache of depth D has one time T with
      ``sum_i size_i (1 - exp(-lambda_i T)) = D``; item i is there with probability
      ``1 - exp(-lambda_i T)``. Users are grouped into rate groups (the top 1,000 alone,
      then groups 2% wide in rank), crossed with the memory sizes and the fact ranks (the
      top 50 alone, then 2% wide), so 10^7 users are ~0.65 M rate groups and a cell takes
      a fraction of a second. Fact sizes do not depend on popularity, so only the mean
      size enters.

Costs (:class:`EncodeCost`)
    A miss re-encodes the fact with its context (the preamble and the ``w`` turns before
    it, Context-Window Encoding). Seconds per token: 46.5 ms for a transformers bf16
    prefill of 1,584 tokens at Llama-3.1-8B's shapes on an NVIDIA H200
    (docs/results/gpu_injection/gpu_injection.md), 29.4 us per token.

The sizing cells, the results page and the plot: :mod:`inferscale.bench.fleet_report`.
Reproduce: ``inferscale bench fleet --out docs/results/fleet`` (docs/sizing.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from inferscale.kv import quant

GIB = 2**30
TIB = 2**40
#: Facts per LoCoMo conversation (``len(sample.facts)`` of the 10 samples of locomo10.json).
LOCOMO_FACT_COUNTS = (184, 169, 324, 266, 267, 277, 268, 291, 240, 255)
#: Tokens of a fact's memory line (``- (<date>) <observation>\n``): mean over LoCoMo's 2,541
#: facts with SmolLM2's tokenizer (docs/results/footprint/footprint.json; docs/deployment.md
#: "GPU sizes on paper"). Llama 3's larger vocabulary gives somewhat fewer: conservative.
TOKENS_PER_FACT = 30.1
#: Tokens of one rendered turn (``- <speaker>: <text>\n``): mean over LoCoMo's 5,882 turns, SmolLM2's tokenizer.
TOKENS_PER_TURN = 37.1
#: Tokens of the preamble (chat template, system prompt, ``Memories:``): the GPU page's shape.
PREAMBLE_TOKENS = 34
#: Seconds of GPU per prefilled token: 46.5 ms / 1,584 tokens (transformers, bf16, Llama-3.1-8B
#: shapes, one H200; docs/results/gpu_injection/gpu_injection.md, k=50 with 31-token facts).
SECONDS_PER_TOKEN = 46.5e-3 / 1584
STORAGE_DTYPES = ("bfloat16", "int8", "int4")
TIER_NAMES = ("device", "host", "disk", "redis")
#: Most users a workload takes (a float64 share per user: 800 MB at 10^8).
MAX_USERS = 10**8
_TOP_USERS = 1000  # users and fact ranks are grouped past these, in groups 2% wide
_TOP_RANKS = 50
_BIN_WIDTH = 1.02


@dataclass(frozen=True)
class KVShape:
    """A model's KV per token: ``num_layers`` x ``num_kv_heads`` x ``head_dim``, K and V.

    The default is Llama-3.1-8B (``config.json``: 32 layers, 8 KV heads, head_dim 128).
    """

    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128

    def fact_bytes(self, tokens, dtype: str):
        """Bytes of one fact's K and V in ``dtype`` (``bfloat16``, ``int8``, ``int4``), scales included.

        :func:`inferscale.kv.quant.nbytes` is affine in the token count (codes and value
        scales per token, key scales once per fact), so ``tokens`` may be a mean (a float)
        or a numpy array of counts; a mean token count gives the mean bytes. bf16: 131,072
        bytes a token at the default shape; int8 67,584 a token + 65,536 a fact; int4
        34,816 a token + 65,536 a fact.

        Returns:
            Bytes (float; an array for an array of token counts).

        Raises:
            ValueError: another dtype, or a token count <= 0.
        """
        if dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage dtype must be one of {', '.join(STORAGE_DTYPES)}, got {dtype!r}")
        if not np.all(np.asarray(tokens) > 0):
            raise ValueError(f"tokens per fact must be > 0, got {tokens}")
        q = "model" if dtype == "bfloat16" else dtype
        two, four = (quant.nbytes(self.num_layers, t, self.num_kv_heads, self.head_dim, q, model_bytes=2)
                     for t in (2, 4))
        per_token = (four - two) / 2
        return two - 2 * per_token + per_token * tokens


@dataclass(frozen=True)
class Workload:
    """Who asks, how often, and what a request retrieves.

    Args:
        users: U, the number of users (>= 1).
        user_zipf: s of the users' Zipf request popularity (>= 0; 0 is uniform).
        fact_zipf: Zipf exponent of retrieval over one user's facts (>= 0).
        memory_counts: facts per user, drawn uniformly per user (each >= 1; LoCoMo's by default).
        k: facts retrieved per request, on average (>= 1; all of a user's facts when it holds fewer).
        tokens_per_fact: mean tokens of a fact's KV (> 0).
        requests_per_user_day: questions a user asks a day, on average (> 0).
        seed: draws each user's memory count (both engines use the same draw).

    Raises:
        ValueError: a value out of range (the message names it).
    """

    users: int
    user_zipf: float = 0.8
    fact_zipf: float = 0.5
    memory_counts: tuple[int, ...] = LOCOMO_FACT_COUNTS
    k: int = 10
    tokens_per_fact: float = TOKENS_PER_FACT
    requests_per_user_day: float = 5.0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.users, bool) or not isinstance(self.users, int) or not 1 <= self.users <= MAX_USERS:
            raise ValueError(f"users must be an integer in 1..{MAX_USERS:.0e}, got {self.users!r}")
        for name in ("user_zipf", "fact_zipf"):
            if not (isinstance(getattr(self, name), (int, float)) and 0 <= getattr(self, name) < math.inf):
                raise ValueError(f"{name} must be a number >= 0, got {getattr(self, name)!r}")
        counts = tuple(self.memory_counts)
        if not counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
            raise ValueError(f"memory_counts must be integers >= 1, got {self.memory_counts!r}")
        object.__setattr__(self, "memory_counts", counts)
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k must be an integer >= 1, got {self.k!r}")
        for name in ("tokens_per_fact", "requests_per_user_day"):
            if not (isinstance(getattr(self, name), (int, float)) and 0 < getattr(self, name) < math.inf):
                raise ValueError(f"{name} must be a number > 0, got {getattr(self, name)!r}")

    @property
    def requests_per_hour(self) -> float:
        """Requests of the whole fleet per hour: ``users x requests_per_user_day / 24``."""
        return self.users * self.requests_per_user_day / 24

    def user_shares(self) -> np.ndarray:
        """``[users]`` float64: each user's share of the requests (Zipf, sums to 1)."""
        p = np.arange(1, self.users + 1, dtype=np.float64) ** -float(self.user_zipf)
        return p / p.sum()

    def user_classes(self) -> np.ndarray:
        """``[users]`` int: each user's index into ``memory_counts`` (seeded draw)."""
        return np.random.default_rng(self.seed).integers(len(self.memory_counts), size=self.users)

    def inclusion(self, count: int) -> np.ndarray:
        """``[count]`` float64: the chance each of a user's ``count`` facts (most retrieved first)
        is in one request; sums to ``min(k, count)`` (:func:`inclusion_probabilities`)."""
        return inclusion_probabilities(count, self.k, self.fact_zipf)


def inclusion_probabilities(count: int, k: int, zipf: float) -> np.ndarray:
    """Poisson-sampling inclusion probabilities ``pi_j = min(1, a j^-zipf)`` with ``sum pi = min(k, count)``.

    Returns ``[count]`` float64, non-increasing. The water level ``a`` is found exactly:
    the first m facts are capped at 1 and the rest share ``k - m`` in proportion to their weight.
    """
    w = np.arange(1, count + 1, dtype=np.float64) ** -float(zipf)
    if k >= count:
        return np.ones(count)
    tail = np.cumsum(w[::-1])[::-1]  # tail[m] = sum of w[m:]
    for m in range(k):
        a = (k - m) / tail[m]
        if a * w[m] <= 1:
            return np.concatenate([np.ones(m), a * w[m:]])
    raise AssertionError("unreachable: k < count always leaves a level")  # pragma: no cover


@dataclass(frozen=True)
class Tiers:
    """Byte budgets of the pool's tiers across a fleet.

    Args:
        machines: serving machines (>= 1); users are split evenly among them.
        device_bytes, host_bytes, disk_bytes: per machine (>= 0): GPU memory, pinned host
            memory and local disk given to fact KV.
        redis_bytes: the shared Redis tier (>= 0; 0: none).

    Raises:
        ValueError: a negative budget or no machine.
    """

    machines: int
    device_bytes: float
    host_bytes: float
    disk_bytes: float
    redis_bytes: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.machines, bool) or not isinstance(self.machines, int) or self.machines < 1:
            raise ValueError(f"machines must be an integer >= 1, got {self.machines!r}")
        for name in ("device_bytes", "host_bytes", "disk_bytes", "redis_bytes"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ValueError(f"{name} must be a number of bytes >= 0, got {value!r}")

    def budgets(self) -> tuple[float, float, float, float]:
        """Fleet totals in bytes: device, host, disk (per machine x machines) and Redis."""
        m = self.machines
        return m * self.device_bytes, m * self.host_bytes, m * self.disk_bytes, float(self.redis_bytes)

    def depths(self) -> tuple[float, float, float, float]:
        """Bytes of the LRU stack reached by device, host, disk and Redis (module docstring)."""
        device, host, disk, redis = self.budgets()
        d_host = device + host
        d_disk = max(d_host, disk)
        return device, d_host, d_disk, max(d_disk, redis)


@dataclass(frozen=True)
class EncodeCost:
    """GPU time of re-encoding one missed fact with its context.

    Args:
        seconds_per_token: prefill seconds per token (default 29.4 us: :data:`SECONDS_PER_TOKEN`).
        preamble_tokens: tokens of the preamble encoded before the turns (default 34).
        context_turns: w, turns encoded before the fact (default 5, the library's default).
        tokens_per_turn: tokens of one rendered turn (default 37.1, LoCoMo's mean).
    """

    seconds_per_token: float = SECONDS_PER_TOKEN
    preamble_tokens: float = PREAMBLE_TOKENS
    context_turns: int = 5
    tokens_per_turn: float = TOKENS_PER_TURN

    def __post_init__(self) -> None:
        for name in ("seconds_per_token", "preamble_tokens", "context_turns", "tokens_per_turn"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")

    def tokens_per_miss(self, fact_tokens: float) -> float:
        """Tokens prefilled to re-encode one fact: preamble + w turns + the fact."""
        return self.preamble_tokens + self.context_turns * self.tokens_per_turn + fact_tokens


class Analytic:
    """Che's approximation for one workload: LRU hit probabilities at any stack depth.

    Time is counted in requests. Items are rate groups: ``rates[g]`` (references per
    request of one fact) held by ``counts[g]`` facts. A group is one memory size crossed
    with users of neighbouring popularity (the top 1,000 alone, then groups 2% wide in
    rank) and facts of neighbouring rank (the top 50 alone, then 2% wide), at the group's
    mean rate: within a group rates differ by at most 2% (for exponents up to 1), which
    moves the hit shares by far less than the approximation's own error (the exact
    engine's check).

    Args:
        workload: the users and their requests.
    """

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        edges = _group_edges(workload.users, _TOP_USERS)
        sizes = np.diff(edges)
        mean_share = np.add.reduceat(workload.user_shares(), edges[:-1]) / sizes
        bins = np.repeat(np.arange(len(sizes)), sizes)
        num_classes = len(workload.memory_counts)
        per_bin = np.bincount(bins * num_classes + workload.user_classes(),
                              minlength=len(sizes) * num_classes).reshape(-1, num_classes).astype(np.float64)
        rates, counts = [], []
        for c, count in enumerate(workload.memory_counts):
            held = per_bin[:, c] > 0
            ranks = _group_edges(count, _TOP_RANKS)
            pi = np.add.reduceat(workload.inclusion(count), ranks[:-1]) / np.diff(ranks)
            rates.append((mean_share[held, None] * pi[None, :]).ravel())
            counts.append((per_bin[held, c, None] * np.diff(ranks)[None, :]).ravel())
        self.rates = np.concatenate(rates)
        self.counts = np.concatenate(counts)
        self.num_facts = float(self.counts.sum())
        #: Fact references per request (``k`` when every user holds at least ``k`` facts).
        self.refs_per_request = float((self.rates * self.counts).sum())
        self._solved: dict[tuple[int, float], float] = {}
        self._ref_weights = self.counts * self.rates / self.refs_per_request  # sums to 1
        self._x, self._stay = np.empty_like(self.rates), np.empty_like(self.rates)

    def _at(self, time: float) -> tuple[float, float, float, float]:
        """Occupancy (facts), hit share, and their derivatives in log T, at ``time`` (requests)."""
        x = np.multiply(self.rates, -time, out=self._x)  # -rate T
        stay = np.exp(x, out=self._stay)  # e^{-rate T}: not referenced within T
        slope = np.multiply(x, stay, out=self._x)  # -rate T e^{-rate T}
        dot = _dot  # not BLAS: its threads spin against a busy machine's other work (30x slower here)
        return (self.num_facts - dot(self.counts, stay), 1.0 - dot(self._ref_weights, stay),
                -dot(self.counts, slope), -dot(self._ref_weights, slope))

    def occupancy(self, time: float) -> float:
        """Facts an LRU of characteristic time ``time`` (requests) holds: ``sum counts (1 - e^{-rate T})``."""
        return self.num_facts if math.isinf(time) else self._at(time)[0]

    def hit(self, time: float) -> float:
        """Share of fact references found in an LRU of characteristic time ``time`` (requests)."""
        return 1.0 if math.isinf(time) else self._at(time)[1]

    def time_for_facts(self, facts: float) -> float:
        """The characteristic time (requests) of an LRU holding ``facts`` facts (``inf``: all fit)."""
        if facts >= self.num_facts:
            return math.inf
        if facts <= 0:
            return 0.0
        return self._solve(facts, value=0, slope=2)

    def time_for_hit(self, target: float) -> float:
        """The characteristic time (requests) at which the hit share reaches ``target`` (0-1)."""
        if target >= 1:
            return math.inf
        if target <= 0:
            return 0.0
        return self._solve(target, value=1, slope=3)

    def hit_at(self, depth_bytes: float, fact_bytes: float) -> float:
        """Hit share of an LRU of ``depth_bytes`` when every fact takes ``fact_bytes``."""
        return self.hit(self.time_for_facts(depth_bytes / fact_bytes))

    def depth_for_hit(self, target: float, fact_bytes: float) -> float:
        """Bytes of LRU stack that serve ``target`` of the references."""
        return fact_bytes * self.occupancy(self.time_for_hit(target))

    def _solve(self, target: float, *, value: int, slope: int) -> float:
        """T with ``_at(T)[value] = target`` (increasing in T): Newton on log T inside a bisection
        bracket, to a relative error of 1e-10 in the value (remembered: cells ask again)."""
        key = (value, float(target))
        if key not in self._solved:
            self._solved[key] = self._newton(target, value, slope)
        return self._solved[key]

    def _newton(self, target: float, value: int, slope: int) -> float:
        lo, hi = -80.0, 80.0
        x = math.log(self.workload.users / max(self.refs_per_request, 1e-300))  # a start; the bracket does the rest
        for _ in range(200):
            at = self._at(math.exp(x))
            err = at[value] - target
            if abs(err) <= 1e-10 * target or hi - lo < 1e-13:
                break
            lo, hi = (x, hi) if err < 0 else (lo, x)
            step = x - err / at[slope] if at[slope] > 0 else math.nan
            x = step if lo < step < hi else (lo + hi) / 2
        return math.exp(x)


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """``a . b`` on one thread (einsum without BLAS)."""
    return float(np.einsum("i,i->", a, b))


def _group_edges(n: int, first: int) -> np.ndarray:
    """Edges of groups over ranks ``0..n-1``: the first ``first`` alone, then groups 2% wide."""
    edges = list(range(min(n, first) + 1))
    while edges[-1] < n:
        edges.append(min(n, max(edges[-1] + 1, math.ceil(edges[-1] * _BIN_WIDTH))))
    return np.asarray(edges)


@dataclass(frozen=True)
class Served:
    """Where fact references were served from.

    Attributes:
        tiers: tier names, stack order.
        shares: per tier, the share of retrieved fact tokens it served (0-1).
        miss_share: the share served by none (re-encoded).
        stored_share: retrieved fact tokens of misses kept (re-encoded or captured) per
            retrieved fact token: ``miss_share`` when every miss is kept, less behind an
            admission rule (:func:`inferscale.bench.fleet_exact.simulate_lru`'s ``admit_window``).
    """

    tiers: tuple[str, ...]
    shares: tuple[float, ...]
    miss_share: float
    stored_share: float | None = None

    @property
    def kv_share(self) -> float:
        """Share of retrieved fact tokens served as KV (any tier)."""
        return 1.0 - self.miss_share

    def hit_rates(self) -> tuple[float | None, ...]:
        """Per tier, the share it serves of the references that reach it (that missed every
        tier above); ``None`` where none reach it."""
        out: list[float | None] = []
        left = 1.0
        for s in self.shares:
            out.append(s / left if left > 1e-12 else None)
            left -= s
        return tuple(out)


def analytic_served(model: Analytic, depths: Sequence[float], fact_bytes: float,
                    tiers: Sequence[str] = TIER_NAMES) -> Served:
    """Shares served per tier from the stack depths (bytes, non-decreasing) by Che's approximation."""
    return served_from_hits([model.hit_at(d, fact_bytes) if d > 0 else 0.0 for d in depths], tiers)


def served_from_hits(hits: Sequence[float], tiers: Sequence[str] = TIER_NAMES) -> Served:
    """:class:`Served` from the hit share at each tier's stack depth (non-decreasing, 0-1):
    tier t serves ``hits[t] - hits[t-1]``."""
    shares = [max(0.0, h - prev) for h, prev in zip(hits, [0.0, *hits[:-1]])]
    return Served(tuple(tiers), tuple(shares), 1.0 - max([0.0, *hits]))


def locomo_fact_counts(path: Path) -> tuple[int, ...]:
    """Facts per conversation of a LoCoMo file (``len(sample.facts)``; 169-324 in locomo10.json).

    Raises:
        FileNotFoundError, inferscale.datasets.locomo.LocomoFormatError: no LoCoMo file there.
    """
    from inferscale.datasets.locomo import load_locomo

    return tuple(len(sample.facts) for sample in load_locomo(Path(path)))
