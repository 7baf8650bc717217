"""The KV pool over time, for the page at ``/ui``: a front worker samples its pool's counters
every :data:`SAMPLE_S` seconds (reads never add samples, so no client can push the day out)
and draws them with matplotlib, at most :data:`PLOT_POINTS` points, one drawing at a time, the
last one reused until a new sample comes.

A sample is this worker's :meth:`inferscale.Memory.kv_stats` at one time: bytes per tier
(the disk's is the folder's, shared by every worker; the device and host tiers are this
process's), and the counters of memories served as KV and as text and of evictions, from
which the plot takes each interval's differences: the KV share of the memories served and
the evictions per interval. With several front workers each keeps its own samples (the page
names the worker that answered).
"""

from __future__ import annotations

import asyncio
import io
import threading
import time
from collections import deque
from typing import Callable

from starlette.concurrency import run_in_threadpool

#: seconds between samples
SAMPLE_S = 10.0
#: samples kept: a day at :data:`SAMPLE_S`
KEEP = 8640
#: most points a plot draws (every n-th sample of the day; the counters are cumulative, so the
#: differences between drawn points still count everything)
PLOT_POINTS = 360
_TIERS = ("device", "host", "disk", "redis")


class PoolHistory:
    """Samples of one worker's KV pool counters, oldest first; thread-safe.

    Args:
        kv_stats: the pool's counters (:meth:`inferscale.Memory.kv_stats`).
        budgets: bytes allowed per tier (``{"device", "host", "disk"}``; ``None``: no limit).
        keep: most samples kept (the oldest go first).
    """

    def __init__(self, kv_stats: Callable[[], dict[str, float]], budgets: dict[str, int | None],
                 keep: int = KEEP) -> None:
        self.kv_stats, self.budgets = kv_stats, budgets
        self._samples: deque[dict] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._plot_lock = threading.Lock()
        self._plotted: tuple[float, bytes] | None = None  # (time of the last sample drawn, the SVG)

    def sample(self) -> dict:
        """Take one sample now: ``{"t" (Unix seconds), "<tier>_bytes", "served_kv", "served_text",
        "served_captured", "evictions"}`` (counters since the worker started)."""
        s = self.kv_stats()
        row = {"t": time.time(), **{f"{t}_bytes": int(s.get(f"{t}_bytes", 0)) for t in ("device", "host", "disk")},
               "served_kv": int(sum(s.get(f"served_{t}", 0) for t in _TIERS)),
               "served_text": int(s.get("served_text", 0)), "served_captured": int(s.get("served_captured", 0)),
               "evictions": int(sum(s.get(f"{t}_evictions", 0) for t in ("device", "host", "disk")))}
        with self._lock:
            self._samples.append(row)
        return row

    def samples(self) -> list[dict]:
        """The samples, oldest first."""
        with self._lock:
            return list(self._samples)

    async def run(self, every_s: float = SAMPLE_S) -> None:
        """Sample every ``every_s`` seconds until cancelled (the front's lifespan runs it)."""
        while True:
            try:
                await run_in_threadpool(self.sample)
            except RuntimeError:  # the memory closed: shutting down
                return
            await asyncio.sleep(every_s)

    def plot_svg(self) -> bytes:
        """The samples drawn as an SVG: bytes per tier against its budget, the KV share of the
        memories served in each interval, and the evictions in each interval (at most
        :data:`PLOT_POINTS` points; the drawing is reused until a new sample comes)."""
        with self._plot_lock:  # one drawing at a time: concurrent readers wait and reuse it
            rows = self.samples()
            last = rows[-1]["t"] if rows else 0.0
            if self._plotted is None or self._plotted[0] != last:
                step = max(1, -(-len(rows) // PLOT_POINTS))
                self._plotted = (last, self._draw(rows[::-1][::step][::-1]))
            return self._plotted[1]

    def _draw(self, rows: list[dict]) -> bytes:
        fig = self.figure(rows)
        out = io.BytesIO()
        fig.savefig(out, format="svg")
        return out.getvalue()

    def figure(self, rows: list[dict]):
        """The plot of ``rows`` (samples, oldest first) as a matplotlib ``Figure`` of three axes:
        MiB held per tier (device drawn over host over disk, each line thinner than the one
        under it, so equal lines all show), the % of memories served as KV per interval, and
        evictions per interval (whole numbers from 0; "no evictions" when there were none)."""
        from matplotlib.figure import Figure  # no pyplot: its global state is not for threads
        from matplotlib.ticker import MaxNLocator

        t0 = rows[-1]["t"] if rows else time.time()
        x = [(r["t"] - t0) / 60 for r in rows]
        fig = Figure(figsize=(8, 6.4))
        held, share, evicted = fig.subplots(3, 1, sharex=True)
        top = max((r[f"{t}_bytes"] for r in rows for t in ("device", "host", "disk")), default=0) / 2**20
        # drawn disk first and device last, each thinner than the one under it: equal lines (every
        # memory on both tiers) show as a line with a border, not one hiding the other
        for tier, colour, width, z in (("disk", "#2e7d32", 5.0, 2), ("host", "#6a1b9a", 3.2, 3),
                                       ("device", "#1565c0", 1.6, 4)):
            budget = (self.budgets.get(tier) or 0) / 2**20
            if not budget and not any(r[f"{tier}_bytes"] for r in rows) and tier == "host":
                continue  # no host tier (a CPU device)
            label = tier if not budget else f"{tier} (budget {budget:,.0f} MiB)"
            held.plot(x, [r[f"{tier}_bytes"] / 2**20 for r in rows], marker=".", color=colour, label=label,
                      linewidth=width, zorder=z)
            if budget and budget <= 4 * max(top, 1e-9):  # a budget far above what is held stays in the legend
                held.axhline(budget, color=colour, linestyle="--", linewidth=1)
        held.set(ylabel="MiB held", title="KV pool of this worker")
        held.legend(fontsize=8, loc="upper left")
        pairs = list(zip(rows, rows[1:]))
        kv = [b["served_kv"] - a["served_kv"] for a, b in pairs]
        text = [b["served_text"] - a["served_text"] for a, b in pairs]
        share.plot(x[1:], [100 * k / (k + t) if k + t else float("nan") for k, t in zip(kv, text)], marker=".",
                   color="#2e7d32")
        share.set(ylabel="% served as KV", ylim=(-5, 105))
        width = 0.8 * min((b - a for a, b in zip(x, x[1:])), default=0.1)
        counts = [b["evictions"] - a["evictions"] for a, b in pairs]
        evicted.bar(x[1:], counts, width=width, color="#c62828")
        evicted.set(ylabel="evictions", xlabel="minutes before the last sample", ylim=(0, max(counts, default=0) + 1))
        evicted.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts: whole numbers, from 0
        if not any(counts):
            evicted.text(0.5, 0.5, "no evictions", transform=evicted.transAxes, ha="center", va="center",
                         color="#777777")
        for ax in (held, share, evicted):
            ax.grid(alpha=0.3)
        fig.tight_layout()
        return fig
