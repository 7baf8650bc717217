"""``inferscale bench fleet``: the fleet simulator's cells, results page and plot.

For each users level, k, user Zipf exponent and storage dtype, the analytic engine
(:class:`inferscale.bench.fleet.Analytic`) gives the shares of retrieved fact tokens each
tier serves at the given budgets, the misses and re-encode GPU seconds per hour, and the
LRU stack bytes that serve the target share (:func:`analytic_cell`); the exact engine
checks the analytic one on a ~10^4-user trace (:func:`inferscale.bench.fleet_exact.validate`).
Writes ``fleet.json``, ``fleet.md`` and ``fleet.png``; docs/sizing.md reads them.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from inferscale.bench.fleet import (GIB, LOCOMO_FACT_COUNTS, STORAGE_DTYPES, TIB, TIER_NAMES, TOKENS_PER_FACT,
                                    Analytic, EncodeCost, KVShape, Served, Tiers, Workload, analytic_served,
                                    served_from_hits)
from inferscale.bench.fleet_exact import admission_study, validate

NAME = "fleet"


@dataclass(frozen=True)
class Cell:
    """One workload, storage dtype and fleet: what the analytic engine says.

    Attributes:
        users, k, user_zipf, fact_zipf, dtype: the cell's settings.
        machines: serving machines.
        fact_bytes: mean bytes of one fact's KV.
        footprint_bytes: KV of every fact of every user.
        budgets_bytes: fleet totals per tier (device, host, disk, Redis).
        held_bytes: bytes each tier holds in steady state (its budget, or less when every fact fits).
        served: shares of retrieved fact tokens per tier at these budgets.
        misses_per_hour, reencode_gpu_s_per_hour: facts re-encoded per hour and their GPU seconds.
        miss_text_gpu_s_per_hour: GPU seconds per hour the misses' own text prefill takes in their
            requests (what text mode pays for them anyway; with capture on a miss, all they cost).
        hit_saved_gpu_s_per_hour: GPU seconds per hour of fact prefill the hits save.
        lru_hours: how long an unused fact stays in the deepest tier (characteristic time; ``inf``: all fit).
        target: the sizing target (share of fact tokens served as KV).
        target_depth_bytes: LRU stack bytes that serve ``target`` (fleet total).
        target_served: shares per tier when the disk (per machine) and Redis hold ``target_depth_bytes``.
        target_gpu_s_per_hour: re-encode GPU seconds per hour at the target.
        target_hours: how long an unused fact stays in the LRU sized for the target.
    """

    users: int
    k: int
    user_zipf: float
    fact_zipf: float
    dtype: str
    machines: int
    fact_bytes: float
    footprint_bytes: float
    budgets_bytes: tuple[float, ...]
    held_bytes: tuple[float, ...]
    served: Served
    misses_per_hour: float
    reencode_gpu_s_per_hour: float
    lru_hours: float
    target: float
    target_depth_bytes: float
    target_served: Served
    target_gpu_s_per_hour: float
    target_hours: float
    miss_text_gpu_s_per_hour: float = 0.0
    hit_saved_gpu_s_per_hour: float = 0.0


def analytic_cell(model: Analytic, tiers: Tiers, dtype: str, *, shape: KVShape = KVShape(),
                  cost: EncodeCost = EncodeCost(), target: float = 0.9) -> Cell:
    """Size one workload (``model``) in ``dtype`` against ``tiers``, and find the bytes for ``target``.

    The target plan keeps the device and host budgets and sizes the inclusive tiers below
    them: each machine's disk, or the shared Redis alone, holds ``target_depth_bytes``
    (when the memory tiers do not already reach it).

    Raises:
        ValueError: ``target`` outside (0, 1).
    """
    if not 0 < target < 1:
        raise ValueError(f"target must be a share in (0, 1), got {target}")
    w = model.workload
    fact_bytes = shape.fact_bytes(w.tokens_per_fact, dtype)
    footprint = fact_bytes * model.num_facts
    depths = tiers.depths()
    served = analytic_served(model, depths, fact_bytes)
    refs_per_hour = w.requests_per_hour * model.refs_per_request
    gpu_s_per_miss = cost.tokens_per_miss(w.tokens_per_fact) * cost.seconds_per_token
    misses = refs_per_hour * served.miss_share
    deepest = model.time_for_facts(depths[-1] / fact_bytes)
    held, prev = [], 0.0
    for name, depth, budget in zip(TIER_NAMES, depths, tiers.budgets()):
        fill = min(depth, footprint)
        held.append(min(budget, fill - prev) if name == "host" else min(budget, fill))
        prev = fill
    target_time = model.time_for_hit(target)
    need = fact_bytes * model.occupancy(target_time)
    d_device, d_host = depths[:2]  # the plan keeps these; disk and Redis reach max(d_host, need)
    memory_hits = [model.hit_at(d, fact_bytes) if d > 0 else 0.0 for d in (d_device, d_host)]
    below = model.hit(target_time) if need > d_host else memory_hits[1]
    target_served = served_from_hits([*memory_hits, below, below])
    return Cell(w.users, w.k, w.user_zipf, w.fact_zipf, dtype, tiers.machines, fact_bytes, footprint,
                tiers.budgets(), tuple(held), served, misses, misses * gpu_s_per_miss,
                deepest / w.requests_per_hour, target, need, target_served,
                refs_per_hour * target_served.miss_share * gpu_s_per_miss, target_time / w.requests_per_hour,
                misses * w.tokens_per_fact * cost.seconds_per_token,
                refs_per_hour * (1 - served.miss_share) * w.tokens_per_fact * cost.seconds_per_token)


def break_even_kv_share(cost: EncodeCost, tokens_per_fact: float) -> float:
    """The share of fact tokens served as KV below which re-encoding every miss costs more GPU
    time than the hits save: a hit saves the fact's prefill (``t`` tokens), a miss adds its
    re-encode (``r`` tokens, :meth:`EncodeCost.tokens_per_miss`), so ``h t = (1 - h) r`` at
    ``h = r / (r + t)``. With capture on a miss a miss adds nothing, and every hit is a saving
    (break-even 0)."""
    r = cost.tokens_per_miss(tokens_per_fact)
    return r / (r + tokens_per_fact)


@dataclass(frozen=True)
class FleetSettings:
    """Everything one ``inferscale bench fleet`` run depends on (see :func:`run`); docs/sizing.md
    gives each default's source.

    Args:
        users: fleet sizes (users).
        dtypes: KV storage dtypes (``bfloat16``, ``int8``, ``int4``).
        ks: facts retrieved per request, on average.
        user_zipfs: Zipf exponents of user activity; the first leads (0.8: the upper end of
            the web's measured 0.64-0.83, Breslau et al. 1999), the others vary it.
        fact_zipfs: Zipf exponents of retrieval over a user's facts; the first leads (0.5:
            fitted to LoCoMo's dense top-k retrieval counts, scripts/fleet_fact_popularity.py).
        requests_per_user_day: questions a user asks a day (5: ChatGPT's reported prompts
            per weekly user).
        users_per_machine: users one serving machine (one H200) takes (assumed).
        device_bytes, host_bytes, disk_bytes: per machine, bytes of fact KV on the GPU
            (32 GiB), in pinned host memory (128 GiB) and on disk (3,576 GiB: one 3.84 TB
            NVMe drive, as a DGX H200 has one a GPU).
        redis_bytes: the shared Redis tier (1 TiB).
        target: share of retrieved fact tokens to serve as KV when sizing (0.9, the issue's).
        memory_counts, memory_counts_source: facts per user (LoCoMo's) and where they were read.
        tokens_per_fact: mean tokens of a fact (30.1, LoCoMo with SmolLM2's tokenizer).
        cost: the GPU time of a re-encode (:class:`~inferscale.bench.fleet.EncodeCost`).
        validate_users, validate_requests: the exact-vs-analytic check (0 users: none).
        admission_requests: requests of the admission study (:func:`admission_study`, exact
            LRU at ``validate_users`` users, k and popularity of the headline, bf16; 0: none).
        seed: draws each user's memory size.

    Raises:
        ValueError: a value out of range (the message names it).
    """

    users: tuple[int, ...] = (10_000, 100_000, 1_000_000, 10_000_000)
    dtypes: tuple[str, ...] = STORAGE_DTYPES
    ks: tuple[int, ...] = (10, 50)
    user_zipfs: tuple[float, ...] = (0.8, 0.6, 1.0)
    fact_zipfs: tuple[float, ...] = (0.5, 0.3, 0.8)
    requests_per_user_day: float = 5.0
    users_per_machine: int = 100_000
    device_bytes: float = 32 * GIB
    host_bytes: float = 128 * GIB
    disk_bytes: float = 3576 * GIB
    redis_bytes: float = 1 * TIB
    target: float = 0.9
    memory_counts: tuple[int, ...] = LOCOMO_FACT_COUNTS
    memory_counts_source: str = "built-in"
    tokens_per_fact: float = TOKENS_PER_FACT
    cost: EncodeCost = field(default_factory=EncodeCost)
    validate_users: int = 10_000
    validate_requests: int = 1_500_000
    admission_requests: int = 600_000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("users", "dtypes", "ks", "user_zipfs", "fact_zipfs"):
            if not getattr(self, name):
                raise ValueError(f"{name} must list at least one value")
        bad = [d for d in self.dtypes if d not in STORAGE_DTYPES]
        if bad:
            raise ValueError(f"storage dtypes must be among {', '.join(STORAGE_DTYPES)}, got {bad}")
        if isinstance(self.users_per_machine, bool) or not isinstance(self.users_per_machine, int) \
                or self.users_per_machine < 1:
            raise ValueError(f"users_per_machine must be an integer >= 1, got {self.users_per_machine!r}")
        if not 0 < self.target < 1:
            raise ValueError(f"target must be a share in (0, 1), got {self.target}")
        if self.validate_users < 0 or self.validate_requests < 1 or self.admission_requests < 0:
            raise ValueError("validate_users and admission_requests must be >= 0 and validate_requests >= 1")
        for users in self.users:
            for k in self.ks:
                for s, f in self.popularities():
                    self.workload(users, k, s, f)  # raises on a bad value
        self.tiers(max(self.users))

    def popularities(self) -> list[tuple[float, float]]:
        """The (user Zipf, fact Zipf) pairs simulated: the first of each (the headline), then each
        other value of one with the first of the other (the sensitivity tables)."""
        s0, f0 = self.user_zipfs[0], self.fact_zipfs[0]
        return [(s0, f0)] + [(s, f0) for s in self.user_zipfs[1:]] + [(s0, f) for f in self.fact_zipfs[1:]]

    def workload(self, users: int, k: int, user_zipf: float, fact_zipf: float) -> Workload:
        """The workload of one cell."""
        return Workload(users=users, user_zipf=user_zipf, fact_zipf=fact_zipf, memory_counts=self.memory_counts,
                        k=k, tokens_per_fact=self.tokens_per_fact, requests_per_user_day=self.requests_per_user_day,
                        seed=self.seed)

    def tiers(self, users: int) -> Tiers:
        """The fleet for ``users``: ``ceil(users / users_per_machine)`` machines at the per-machine budgets."""
        return Tiers(-(-users // self.users_per_machine), self.device_bytes, self.host_bytes, self.disk_bytes,
                     self.redis_bytes)


def run(out_dir: Path, settings: FleetSettings = FleetSettings(), *, command: str = "inferscale bench fleet") -> dict:
    """Simulate every (users, k, popularity pair, dtype) cell; write ``fleet.{json,md,png}`` into ``out_dir``.

    Returns:
        The summary written to ``fleet.json``.
    """
    from inferscale.bench.common import machine, write_outputs
    from inferscale.bench.plots import plot_fleet

    cells, curves = [], []
    s0, f0, k0 = settings.user_zipfs[0], settings.fact_zipfs[0], settings.ks[0]
    for s, f in settings.popularities():
        for k in settings.ks:
            for users in settings.users:
                model = Analytic(settings.workload(users, k, s, f))
                tiers = settings.tiers(users)
                for dtype in settings.dtypes:
                    cells.append(analytic_cell(model, tiers, dtype, cost=settings.cost, target=settings.target))
                if (s, f, k, users) == (s0, f0, k0, _headline_users(settings)):
                    curves = _curve(model, settings)
    checked = None
    if settings.validate_users:
        checked = validate(settings.workload(settings.validate_users, k0, s0, f0),
                           requests=settings.validate_requests, seed=settings.seed + 1)
    admission = None
    if settings.validate_users and settings.admission_requests:
        admission = admission_study(settings.workload(settings.validate_users, k0, s0, f0),
                                    settings.tiers(settings.validate_users).depths(),
                                    requests=settings.admission_requests, cost=settings.cost, seed=settings.seed + 3)
    headline = {"users": _headline_users(settings), "k": k0, "user_zipf": s0, "fact_zipf": f0}
    summary = {"date": datetime.date.today().isoformat(), "command": command, "settings": _jsonable(settings),
               "headline": headline, "cells": [_jsonable(c) for c in cells], "curve": curves,
               "validation": None if checked is None else _jsonable(checked), "admission": admission}
    write_outputs(out_dir, NAME, summary, to_markdown({**summary, "machine": machine()}))
    plot_fleet(summary, Path(out_dir) / f"{NAME}.png")
    return summary


def _headline_users(settings: FleetSettings) -> int:
    """The users level the page leads with: 10^6 when asked for, else the largest."""
    return 1_000_000 if 1_000_000 in settings.users else max(settings.users)


def _curve(model: Analytic, settings: FleetSettings) -> list[dict]:
    """KV share vs fleet stack bytes, per dtype, for the plot (40 points, log-spaced hit targets)."""
    out = []
    for target in np.concatenate([np.linspace(0.05, 0.95, 19), [0.97, 0.98, 0.99]]):
        facts = model.occupancy(model.time_for_hit(float(target)))
        out.append({"kv_share": float(target),
                    "bytes": {d: facts * KVShape().fact_bytes(model.workload.tokens_per_fact, d)
                              for d in settings.dtypes}})
    return out


def _jsonable(obj):
    if hasattr(obj, "__dataclass_fields__"):
        out = {name: _jsonable(getattr(obj, name)) for name in obj.__dataclass_fields__}
        if isinstance(obj, Served):
            out["kv_share"] = obj.kv_share
            out["hit_rates"] = list(obj.hit_rates())
        return out
    if isinstance(obj, (list, tuple)):
        return [_jsonable(x) for x in obj]
    if isinstance(obj, float) and math.isinf(obj):
        return None
    return obj


def _size(n: float) -> str:
    """Bytes in binary units, three significant digits."""
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def to_markdown(summary: dict) -> str:
    """The results page: run, parameters, validation, sizing for the target, shares at the budgets."""
    from inferscale.bench.common import markdown_table

    st, cells, m = summary["settings"], summary["cells"], summary["machine"]
    s0, f0, k0 = st["user_zipfs"][0], st["fact_zipfs"][0], st["ks"][0]
    cost = st["cost"]
    lines = [
        "# Fleet KV sizing by simulation",
        "",
        f"**Run**: {summary['date']}, {m['cpu']} ({m['cores']} cores), CPU only and model-free: "
        f"sizes and costs are parameters; commit {m['commit']}. The analytic engine (Che's approximation) "
        "gives every cell; the exact LRU simulation checks it below. How to read it: "
        "[Sizing a fleet](../../sizing.md).",
        "",
        "```bash",
        summary["command"],
        "```",
        "",
        "## Parameters",
        "",
        markdown_table(["parameter", "value"], [
            ["users", ", ".join(f"{u:,}" for u in st["users"])],
            ["user popularity", f"Zipf s = {', '.join(str(s) for s in st['user_zipfs'])} (first: headline)"],
            ["questions per user per day", st["requests_per_user_day"]],
            ["facts per user", f"one of {', '.join(map(str, st['memory_counts']))} each "
                               f"(LoCoMo's conversations; {st['memory_counts_source']})"],
            ["tokens per fact", st["tokens_per_fact"]],
            ["facts retrieved per request (k)", ", ".join(map(str, st["ks"]))],
            ["retrieval over a user's facts", f"Zipf {', '.join(str(f) for f in st['fact_zipfs'])} (first: "
                                              "headline; [fit to LoCoMo](fact_popularity.md)), Poisson "
                                              "sampling of k facts on average"],
            ["KV shape", "Llama-3.1-8B: 32 layers x 8 KV heads x 128, K and V"],
            ["users per machine", f"{st['users_per_machine']:,}"],
            ["per machine: device / host / disk", f"{_size(st['device_bytes'])} / {_size(st['host_bytes'])} / "
                                                  f"{_size(st['disk_bytes'])}"],
            ["shared Redis", _size(st["redis_bytes"])],
            ["re-encode of a miss", f"{cost['preamble_tokens']} + {cost['context_turns']} x "
                                   f"{cost['tokens_per_turn']} + {st['tokens_per_fact']} tokens at "
                                   f"{cost['seconds_per_token'] * 1e6:.1f} us/token (H200 prefill)"],
            ["target", f">= {_pct(st['target'])} of retrieved fact tokens served as KV"],
        ]),
    ]
    v = summary["validation"]
    if v is not None:
        rows = [[name, _pct(e), _pct(a), f"{100 * (a - e):+.2f}"]
                for name, e, a in zip(v["exact"]["tiers"], v["exact"]["shares"], v["analytic"]["shares"])]
        rows.append(["all tiers (KV)", _pct(v["exact"]["kv_share"]), _pct(v["analytic"]["kv_share"]),
                     f"{100 * (v['analytic']['kv_share'] - v['exact']['kv_share']):+.2f}"])
        lines += ["", f"## Analytic vs exact LRU ({v['users']:,} users, k={k0}, user Zipf {s0}, fact Zipf {f0})", "",
                  f"{v['requests']:,} requests ({v['references']:,} fact references, the first {v['warmup']:,} warm "
                  f"the caches); each fact {v['tokens_range'][0]}-{v['tokens_range'][1]} tokens (drawn), bf16; "
                  f"stack depths at {', '.join(_pct(x) for x in v['depth_shares'])} of all facts' bytes "
                  f"({', '.join(_size(d) for d in v['depths_bytes'])}). Shares of retrieved fact tokens:",
                  "", markdown_table(["tier", "exact", "analytic", "gap (points)"], rows), "",
                  f"Largest gap: **{100 * v['max_gap']:.2f} percentage points**."]
    head = [c for c in cells if (c["user_zipf"], c["fact_zipf"]) == (s0, f0)]
    lines += ["", f"## Bytes for >= {_pct(st['target'])} of fact tokens as KV", "",
              "Device and host at their budgets; the disk of each machine (or the shared Redis alone) holds the "
              "LRU stack depth needed. GPU-s/h: re-encode GPU seconds per hour. Hours: how long an unused fact "
              "stays in that LRU.", ""]
    rows = []
    for c in head:
        t = c["target_served"]
        rows.append([f"{c['users']:,}", c["k"], c["dtype"], _size(c["footprint_bytes"]),
                     _size(c["target_depth_bytes"]), _pct(c["target_depth_bytes"] / c["footprint_bytes"]),
                     c["machines"], _size(c["target_depth_bytes"] / c["machines"]),
                     " / ".join(_pct(x) for x in t["shares"][:3]), f"{c['target_gpu_s_per_hour']:,.0f}",
                     f"{c['target_hours']:.3g}"])
    lines.append(markdown_table(["users", "k", "dtype", "all facts' KV", "needed (fleet)", "of all", "machines",
                                 "disk per machine", "served: device / host / disk", "GPU-s/h", "hours"], rows))
    even = break_even_kv_share(EncodeCost(**cost), st["tokens_per_fact"])
    lines += ["", "## What a miss costs: re-encoded (before) or captured (after)", "",
              "GPU seconds per hour at the budgets. A miss is served as text: its fact's prefill runs in its "
              "request either way (text GPU-s/h, what prompt text costs for it). Re-encoding it then adds "
              f"{cost['preamble_tokens']} + {cost['context_turns']} x {cost['tokens_per_turn']} + "
              f"{st['tokens_per_fact']} tokens of prefill; capturing it from the request's own prefill "
              "(`capture_kv`, issue 39) adds none (a copy of its KV out of the paged cache, no compute). "
              f"Break-even share of fact tokens as KV: **{_pct(even)} re-encoding every miss, 0% capturing** "
              "(every hit then saves, and no miss costs more than its text).", ""]
    rows = []
    for c in head:
        saved, text, re = c["hit_saved_gpu_s_per_hour"], c["miss_text_gpu_s_per_hour"], c["reencode_gpu_s_per_hour"]
        rows.append([f"{c['users']:,}", c["k"], c["dtype"], _pct(c["served"]["kv_share"]), f"{text:,.0f}",
                     f"{re:,.0f} ({re / text:.1f}x text)" if text else f"{re:,.0f}", "0 (0.0x text)",
                     f"{saved:,.0f}", f"{saved - re:+,.0f}", f"{saved:+,.0f}"])
    lines.append(markdown_table(["users", "k", "dtype", "KV", "misses' text prefill", "before: re-encodes",
                                 "after: captures", "hits save", "net before", "net after"], rows))
    if summary.get("admission"):
        lines += ["", f"## Admission on a second use ({st['validate_users']:,} users, k={k0}, bf16, exact LRU)", "",
                  "`kv_admission_window_s`: while keeping a miss would evict, it is kept only when the same fact "
                  "missed within the window; a pool with room keeps every miss. One drawn trace of "
                  f"{st['admission_requests']:,} requests (the last third counted), replayed per window at the "
                  "default budgets. Kept: tokens of misses kept (captured, or re-encoded) per retrieved token; "
                  "GPU-s/h if each kept miss were re-encoded (`capture_kv` off; captured, they cost no GPU time).",
                  ""]
        rows = [["every miss kept" if a["hours"] is None else f"{a['hours']:g} h", _pct(a["kv_share"]),
                 _pct(a["stored_share"]), f"{a['kept_reencode_gpu_s_per_hour']:,.1f}",
                 f"{a['miss_text_gpu_s_per_hour']:,.1f}", f"{a['hit_saved_gpu_s_per_hour']:,.1f}"]
                for a in summary["admission"]]
        lines.append(markdown_table(["window", "KV", "misses kept", "re-encode GPU-s/h", "misses' text GPU-s/h",
                                     "hits save GPU-s/h"], rows))
    lines += ["", "## At the budgets", "",
              "Shares of retrieved fact tokens served per tier; hit rate of a tier = what it serves of what "
              "reaches it (-: nothing reaches it). Hours: how long an unused fact stays in the deepest tier.", ""]
    rows = []
    for c in head:
        sv = c["served"]
        rows.append([f"{c['users']:,}", c["k"], c["dtype"], " / ".join(_pct(x) for x in sv["shares"]),
                     _pct(sv["kv_share"]), " / ".join("-" if x is None else _pct(x) for x in sv["hit_rates"]),
                     f"{c['misses_per_hour']:,.0f}", f"{c['reencode_gpu_s_per_hour']:,.0f}",
                     "all fit" if c["lru_hours"] is None else f"{c['lru_hours']:.3g}"])
    lines.append(markdown_table(["users", "k", "dtype", "served: device / host / disk / Redis", "KV",
                                 "hit rate per tier", "misses/h", "GPU-s/h", "hours"], rows))
    for label, key, values, fixed in (("user popularity", "user_zipf", st["user_zipfs"], ("fact_zipf", f0)),
                                      ("retrieval over a user's facts", "fact_zipf", st["fact_zipfs"],
                                       ("user_zipf", s0))):
        if len(values) < 2:
            continue
        lines += ["", f"## Sensitivity to {label}: bytes for >= {_pct(st['target'])} (fleet total, k={k0})", "",
                  f"{fixed[0].replace('_', ' ')} {fixed[1]}; in brackets, the share of all facts' KV.", ""]
        rows = []
        for c in head:
            if c["k"] != k0:
                continue
            same = [next(x for x in cells if x[key] == v and x[fixed[0]] == fixed[1] and x["users"] == c["users"]
                         and x["k"] == k0 and x["dtype"] == c["dtype"]) for v in values]
            rows.append([f"{c['users']:,}", c["dtype"]] + [
                f"{_size(x['target_depth_bytes'])} ({_pct(x['target_depth_bytes'] / x['footprint_bytes'])})"
                for x in same])
        lines.append(markdown_table(["users", "dtype"] + [f"{key.replace('_', ' ')} {v}" for v in values], rows))
    return "\n".join(lines) + "\n"
