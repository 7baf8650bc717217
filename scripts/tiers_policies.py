"""Eviction policies on the tiers replay's own reference string, offline: why the disk tier is LRFU.

The questions of ``inferscale bench tiers`` (its Zipf trace over its users, same seed), each
retrieving its top k facts from the replay's store (hybrid search, as ``generate`` does),
give the reference string: every retrieved fact, in order, weighed by its tokens and sized
in bytes by its tokens (KV bytes are proportional to tokens). A cache of a share of the full
pool's bytes is replayed on it, reference by reference, under each policy: LRU, LFU (no
decay), LRFU with a half-life counted in questions (the disk tier's order,
:mod:`inferscale.kv.disk`), admission on a second miss (2Q-like) in front of LRU, and
Belady's MIN (:mod:`inferscale.bench.clairvoyant`). Misses are admitted at once (the live
replay re-encodes them in the background, a little later) and evictions go down to 90% of
the budget, as the disk tier's do; every cache starts warm as Belady's does (holding the facts
the trace uses first, as many as fit: the live replays start from a full pool) and the first
``warmup`` questions are not counted. No model runs: the store's search only.

    inferscale bench tiers ...             # or let this script store the facts (no KV) in <data dir>/bench-tiers
    python scripts/tiers_policies.py --questions 3000 --warmup 1000 --out docs/results/tiers/policies.md

About a minute on two cores.
"""

from __future__ import annotations

import argparse
import datetime
import math
from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import NamedTuple

from inferscale.bench.clairvoyant import belady_token_share
from inferscale.bench.common import machine, markdown_table, print_page
from inferscale.bench.tiers import make_trace
from inferscale.config import default_data_dir
from inferscale.datasets.locomo import load_locomo, store_conversation
from inferscale.memory import Memory


def references(store: Path, data: Path, users: int, questions: int, zipf: float, k: int, seed: int,
               stored_users: int = 12):
    """The trace's retrieved fact ids per question, every fact's tokens, all facts' tokens, and
    how many facts the users hold.

    Users beyond the store's ``stored_users`` (``--users`` larger than the replay's) repeat
    conversation ``u mod 10`` as the replay does, under fact ids of their own
    (``<id>#<user>``): the same retrievals, other KV."""
    convs = load_locomo(data)
    stored = [f"tiers-{i}" for i in range(min(users, stored_users))]
    if not (Path(store) / "chroma").is_dir():  # the facts only, as `inferscale bench tiers` stores them (no KV)
        with Memory(data_dir=store, precompute_kv=False, context_window=0, top_k=k) as mem:
            for i, scope in enumerate(stored):
                store_conversation(mem, convs[i % len(convs)], scope, progress=f"store {scope}")
    asked = [[q.question for q in convs[i % len(convs)].qa if q.category in (1, 2, 3, 4)] for i in range(users)]
    trace = make_trace([len(a) for a in asked], questions, zipf, seed)
    tokens: dict[str, int] = {}
    hits: dict[tuple[int, int], list[str]] = {}
    per_scope: dict[str, int] = {}
    counts: dict[str, int] = {}
    with Memory(data_dir=store, precompute_kv=False, context_window=0, top_k=k) as mem:
        for s in stored:
            for m in mem.get_all(user_id=s, limit=100_000)["results"]:
                tokens[m["id"]] = mem.fact_tokens(m["memory"])
            held = mem.get_all(user_id=s, limit=100_000)["results"]
            per_scope[s] = sum(tokens[m["id"]] for m in held)
            counts[s] = len(held)
        for u, qi in trace:
            if (u, qi) not in hits:
                scope = stored[u] if u < len(stored) else stored[u % len(convs)]
                found = [m["id"] for m in mem.search(asked[u][qi], user_id=scope, limit=k)["results"]]
                if u >= len(stored):
                    for i in found:
                        tokens[f"{i}#{u}"] = tokens[i]
                    found = [f"{i}#{u}" for i in found]
                hits[(u, qi)] = found
    owner = [stored[u] if u < len(stored) else stored[u % len(convs)] for u in range(users)]
    return [hits[q] for q in trace], tokens, sum(per_scope[o] for o in owner), sum(counts[o] for o in owner)


class Replayed(NamedTuple):
    """One replay's counted questions: ``share`` of the retrieved fact tokens served from the
    cache; ``stored`` fact tokens admitted into it (what misses cost to keep: re-encoded, or
    captured and written); ``misses`` fact tokens served as text."""

    share: float
    stored: int
    misses: int


def replay(refs, tokens, budget: float, warmup: int, *, half_life: float | None = None, lfu: bool = False,
           admit_window: float | None = None) -> Replayed:
    """Replay a cache of ``budget`` tokens' bytes: LRU by default; LFU; LRFU when
    ``half_life`` (questions) is given. ``admit_window`` (questions): a miss is kept only when
    the same fact missed before within that many questions (admission on a second use, the
    ``kv_admission_window_s`` rule; ``math.inf``: any earlier miss, 2Q-like); ``None`` keeps
    every miss."""
    cache: OrderedDict[str, float] = OrderedDict()
    count: dict[str, float] = defaultdict(float)
    missed: dict[str, int] = {}  # fact -> the question of its last miss that was not kept
    held = hit = total = stored = 0
    first_use = list(dict.fromkeys(key for keys in refs for key in keys))
    for key in first_use:  # warm, as the live replays and Belady start: the facts used first, as many as fit
        if held + tokens[key] <= budget:
            cache[key] = 0
            held += tokens[key]
            if half_life is not None:
                count[key] = -1.0  # one use just before the trace
    for q, keys in enumerate(refs):
        for key in keys:
            t = tokens[key]
            counted = q >= warmup
            total += t if counted else 0
            if half_life is not None:  # the priority p = t_last + H log2(count), updated as disk.used_priority
                old = count.get(key)
                count[key] = q if old is None else max(old, q) + half_life * math.log2(
                    1 + 2 ** (-abs(old - q) / half_life))
            elif lfu:
                count[key] += 1
            if key in cache:
                hit += t if counted else 0
                cache.move_to_end(key)
                continue
            if admit_window is not None:
                last = missed.get(key)
                if last is None or q - last > admit_window:
                    missed[key] = q
                    continue
                del missed[key]
            stored += t if counted else 0
            cache[key] = 0
            held += t
            if held > budget:
                order = list(cache) if half_life is None and not lfu else sorted(cache, key=count.__getitem__)
                for out in order:
                    if held <= 0.9 * budget:
                        break
                    if out != key:
                        held -= tokens[out]
                        del cache[out]
    return Replayed(hit / total if total else 0.0, stored, total - hit)


#: admission windows replayed (questions; the LRFU rows halve a use's weight in 300)
ADMISSION_WINDOWS = (25, 100, 300, 1000, math.inf)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", type=Path, default=None, help="the replay's store (default <data dir>/bench-tiers)")
    ap.add_argument("--data", type=Path, default=Path("../shared/data/locomo/locomo10.json"))
    ap.add_argument("--users", type=int, nargs="+", default=[12],
                    help="populations: the first gets every policy and budget, each one a row at 25%%")
    ap.add_argument("--questions", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the page here too")
    a = ap.parse_args()
    store = a.store or default_data_dir() / "bench-tiers"
    policies = [("LRU", {}), ("LRU, admitted on a second miss", {"admit_window": math.inf}), ("LFU", {"lfu": True}),
                ("LRFU, half-life 100 questions", {"half_life": 100.0}),
                ("LRFU, half-life 300 questions", {"half_life": 300.0})]
    shares = (0.5, 0.25, 0.1)
    by_users = []
    for n, users in enumerate(a.users):
        refs, tokens, full, held = references(store, a.data, users, a.questions, a.zipf, a.k, a.seed)
        facts = len({x for r in refs for x in r})
        if n == 0:
            first = (users, refs, full, facts)
            rows = [[name] + [f"{replay(refs, tokens, full * s, a.warmup, **kw).share:.1%}" for s in shares]
                    for name, kw in policies]
            admission = []
            for name, kw in (policies[0], policies[4]):
                for share in (0.25, 0.1):
                    every = replay(refs, tokens, full * share, a.warmup, **kw)
                    for window in (None, *ADMISSION_WINDOWS):
                        r = every if window is None else replay(refs, tokens, full * share, a.warmup,
                                                                admit_window=window, **kw)
                        admission.append([name, f"{share:.0%}", "every miss kept" if window is None else
                                          "any earlier miss" if window == math.inf else f"{window:g} questions", f"{r.share:.1%}",
                                          f"{100 * r.stored / (a.questions - a.warmup):,.0f}",
                                          f"{r.stored / every.stored:.2f}x" if every.stored else "-"])
            rows.append(["Belady's MIN (clairvoyant)"]
                        + [f"{belady_token_share(refs, tokens, tokens, int(full * s), a.warmup):.1%}" for s in shares])
        quarter = full * 0.25
        by_users.append([f"{users}", f"{held:,}", f"{facts:,} ({facts / held:.0%})"]
                        + [f"{replay(refs, tokens, quarter, a.warmup, **kw).share:.1%}" for _, kw in
                           (policies[0], policies[2], policies[4])]
                        + [f"{belady_token_share(refs, tokens, tokens, int(quarter), a.warmup):.1%}"])
    users, refs, full, facts = first
    m = machine()
    page = f"""# Eviction policies on the tiers replay's reference string (offline)

Run {datetime.date.today().isoformat()} on {m['cpu']} ({m['cores']} cores), model-free, commit {m.get('commit', '?')}.

{users} users (conversation i mod 10 each), Zipf s = {a.zipf}, k = {a.k}, {a.questions:,} questions of which the first {a.warmup:,} are not
counted (seed {a.seed}); {sum(map(len, refs)):,} references to {facts:,} of the store's facts;
budgets are shares of all facts' tokens ({full:,}). Share of retrieved fact tokens served from the cache:

{markdown_table(["policy"] + [f"{s:.0%} of the pool" for s in shares], rows)}

## By population, at 25% of the pool

The same trace length and skew over more users (users past the store's 12 repeat conversation
u mod 10 under fact ids of their own): the pool grows with every user, the facts one trace
asks about grow more slowly, so a quarter of the pool holds more of them. A trace is a
short horizon: what a fleet needs over days is [Sizing a fleet](../../sizing.md)'s.

{markdown_table(["users", "facts held", "facts asked about", "LRU", "LFU", "LRFU, 300 questions",
                 "Belady's MIN"], by_users)}

## Admission on a second use

`kv_admission_window_s`: a miss is kept only when the same fact missed within the window
(counted in questions here; the cache starts full, so every miss would evict). Stored: fact
tokens of misses kept per 100 counted questions (what keeping costs: captures written, or
re-encodes with `capture_kv` off), and against keeping every miss. {a.users[0]} users, as above.

{markdown_table(["policy", "budget", "window", "served as KV", "tokens stored / 100 questions",
                 "stored vs every miss kept"], admission)}

Reproduce: `python scripts/tiers_policies.py --users {' '.join(map(str, a.users))} --zipf {a.zipf} --questions {a.questions} --warmup {a.warmup}`
(it stores the facts in `inferscale bench tiers`' store when that is missing; about a minute a population on two cores).
"""
    print_page(page, a.out)


if __name__ == "__main__":
    main()
