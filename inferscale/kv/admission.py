"""Admission on a second use: which misses are worth keeping as KV.

A memory served as text (a miss) can be kept as KV: captured from its request's own prefill
(``capture_kv``) or encoded in the background. Keeping costs a disk write (and, encoded, GPU
time) and, under a budget, evicts something else. A memory used once in a long while is
evicted again before its next use, so keeping it pays for nothing: the disk cache's classic
"one-hit wonders". The rule here keeps a miss only when the same memory missed before within
``window_s`` seconds, as a doorkeeper in front of the cache does (Akamai's "cache on second hit";
TinyLFU's doorkeeper, Einziger et al., ACM TOS 2017), and only while keeping would evict
(the pool under pressure): a pool with room keeps every miss, so the rule never leaves a
budget unfilled.

What it does to this project's pool is measured offline on the tiers replay's reference string
(``scripts/tiers_policies.py``, docs/results/tiers/policies.md) and in the fleet simulator
(``inferscale bench fleet``): docs/decisions.md, "Admission on a second use".
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable, Sequence

#: Misses remembered at most (oldest forgotten first): about 10 MB of keys.
MAX_REMEMBERED = 100_000


class SecondUseAdmission:
    """Keep a miss only on its second use within ``window_s`` seconds.

    Thread-safe; state is per process (two front workers each need their own second miss:
    route a user to one worker to keep the rule exact).

    Args:
        window_s: seconds within which a second miss of the same key admits it; ``0`` admits
            every miss (the rule off).
        max_remembered: first misses remembered at most; the oldest are forgotten first.
        clock: monotonic seconds (tests pass their own).

    Raises:
        ValueError: a negative or non-finite ``window_s``, or ``max_remembered`` < 1.
    """

    def __init__(self, window_s: float, *, max_remembered: int = MAX_REMEMBERED,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not (isinstance(window_s, (int, float)) and 0 <= window_s < float("inf")):
            raise ValueError(f"the admission window is a finite number of seconds >= 0 (0 keeps every miss), "
                             f"got {window_s!r}")
        if max_remembered < 1:
            raise ValueError(f"max_remembered must be >= 1, got {max_remembered}")
        self.window_s = float(window_s)
        self.max_remembered = max_remembered
        self._clock = clock
        self._first: OrderedDict[str, float] = OrderedDict()  # key -> when it missed and was not kept
        self._lock = threading.Lock()
        #: misses kept, and misses not kept (their first use in the window), since start
        self.admitted = 0
        self.refused = 0

    @property
    def enabled(self) -> bool:
        """Whether the rule refuses anything (a window above 0)."""
        return self.window_s > 0

    def admit(self, keys: Sequence[str], *, pressure: bool = True) -> list[bool]:
        """For each missed key, whether to keep its KV now; remembers the ones refused.

        Args:
            keys: the missed memories' KV keys (any stable id per memory and format).
            pressure: whether keeping evicts other KV (:attr:`KVPool.under_pressure`);
                without pressure every miss is kept, as when the rule is off.

        Returns:
            One bool per key, in order: ``True`` for a second miss within the window (or
            every miss when the rule is off or nothing would be evicted).
        """
        if not self.enabled or not pressure:
            self.admitted += len(keys)
            return [True] * len(keys)
        now = self._clock()
        out = []
        with self._lock:
            for key in keys:
                first = self._first.pop(key, None)
                keep = first is not None and now - first <= self.window_s
                if not keep:
                    self._first[key] = now
                    while len(self._first) > self.max_remembered:
                        self._first.popitem(last=False)
                out.append(keep)
            self.admitted += sum(out)
            self.refused += len(out) - sum(out)
        return out
