"""What a clairvoyant cache would serve on a recorded trace: Belady's MIN, in bytes.

The ceiling beside the measured policies of ``inferscale bench tiers``: replaying the same
reference string (each question's retrieved facts, in order), a cache that knows every
future reference keeps, when it must let something go, the entries used again furthest in
the future, and does not keep an entry that is never used again (Belady, "A study of
replacement algorithms for a virtual-storage computer", IBM Systems Journal 1966). With
entries of one size this is optimal; with sizes (facts of 10 to 80 tokens here) the optimum
is NP-hard and MIN is the standard practical ceiling (Berger et al., "Practical bounds on
optimal caching with variable object sizes", SIGMETRICS 2018, measure it within a few points
of the optimum on real traces).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence


def belady_token_share(refs: Sequence[Sequence[str]], tokens: Mapping[str, int], sizes: Mapping[str, int],
                       budget_bytes: int, warmup: int = 0) -> float:
    """Share of referenced tokens a clairvoyant cache of ``budget_bytes`` serves from cache.

    Args:
        refs: per question, the keys it reads, in order. The cache starts warm, as the
            replays start from a full pool: holding the keys first used soonest, each that
            fits, in order of first use.
        tokens: tokens of each key (the weight of a hit or a miss).
        sizes: bytes of each key's entry.
        budget_bytes: the cache's capacity (bytes).
        warmup: first questions not counted (they fill the cache).

    Returns:
        hit tokens / referenced tokens over questions ``warmup`` onwards (0.0 when none).

    Raises:
        ValueError: a negative budget or warmup. KeyError: a key without tokens or size.
    """
    if budget_bytes < 0 or warmup < 0:
        raise ValueError(f"need budget_bytes >= 0 and warmup >= 0, got {budget_bytes} and {warmup}")
    seq = [(q, key) for q, keys in enumerate(refs) for key in keys]
    next_use = [math.inf] * len(seq)
    seen: dict[str, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        key = seq[i][1]
        next_use[i] = seen.get(key, math.inf)
        seen[key] = i
    cache: dict[str, float] = {}  # key -> its next use
    held = hit = total = 0
    for key, first in sorted(seen.items(), key=lambda kv: kv[1]):  # warm start
        if held + sizes[key] <= budget_bytes:
            cache[key] = first
            held += sizes[key]
    for i, (q, key) in enumerate(seq):
        counted = q >= warmup
        total += tokens[key] if counted else 0
        if key in cache:
            hit += tokens[key] if counted else 0
            cache[key] = next_use[i]
            continue
        if sizes[key] > budget_bytes:  # can never be kept: nothing else is given up for it
            continue
        cache[key] = next_use[i]
        held += sizes[key]
        while held > budget_bytes:  # the furthest next use goes (possibly the newcomer: not kept)
            out = max(cache, key=cache.__getitem__)
            held -= sizes[out]
            del cache[out]
    return hit / total if total else 0.0
