"""The benchmarks' PNG plots (matplotlib, headless), drawn from their summaries."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_latency(summary: dict, path: Path) -> None:
    """TTFT (median, p90 as the bar's top) and end-to-end median vs k, one line per mode."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in dict.fromkeys(c["mode"] for c in summary["cells"]):
        cs = [c for c in summary["cells"] if c["mode"] == mode]
        ks = [c["k"] for c in cs]
        med = [c["ttft_median_ms"] for c in cs]
        p90 = [c["ttft_p90_ms"] - c["ttft_median_ms"] for c in cs]
        ax1.errorbar(ks, med, yerr=[[0] * len(cs), p90], marker="o", capsize=3, label=mode)
        ax2.plot(ks, [c["e2e_median_ms"] for c in cs], marker="o", label=mode)
    ax1.set(xlabel="facts retrieved (k)", ylabel="TTFT (ms), median with p90", title="Time to first token")
    ax2.set(xlabel="facts retrieved (k)", ylabel="ms, median", title="End to end (retrieval + TTFT)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    _save(fig, path)


def plot_throughput(summary: dict, path: Path) -> None:
    """Requests/s and TTFT p50/p99 vs concurrent users, inject vs text."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in dict.fromkeys(c["mode"] for c in summary["cells"]):
        cs = [c for c in summary["cells"] if c["mode"] == mode]
        users = [c["users"] for c in cs]
        ax1.plot(users, [c["requests_per_s"] for c in cs], marker="o", label=mode)
        line = ax2.plot(users, [c["ttft_p50_ms"] for c in cs], marker="o", label=f"{mode} p50")[0]
        ax2.plot(users, [c["ttft_p99_ms"] for c in cs], marker="x", linestyle="--", color=line.get_color(),
                 label=f"{mode} p99")
    ax1.set(xlabel="concurrent users", ylabel="requests / s", title="Throughput", xscale="log", yscale="log")
    ax2.set(xlabel="concurrent users", ylabel="TTFT (ms)", title="TTFT under load", xscale="log", yscale="log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    _save(fig, path)


def plot_quality(summary: dict, path: Path) -> None:
    """Token F1 and answer NLL vs k per mode (held-out answers), and retrieval recall@k."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    cells = [c for c in summary["cells"] if c.get("split", "held_out") == "held_out"]  # the held-out answers
    for mode in dict.fromkeys(c["mode"] for c in cells):
        cs = sorted((c for c in cells if c["mode"] == mode), key=lambda c: c["k"])
        ks = [c["k"] for c in cs]
        axes[0].plot(ks, [c["f1_mean"] for c in cs], marker="o", label=mode)
        axes[1].plot(ks, [c["nll_mean"] for c in cs], marker="o", label=mode)
    rec = summary["recall"]
    axes[2].plot([r["k"] for r in rec], [r["recall_mean"] for r in rec], marker="o", color="k")
    axes[0].set(xlabel="k", ylabel="token F1 (mean)", title="Answer F1")
    axes[1].set(xlabel="k", ylabel="nats / token (mean)", title="Gold answer NLL")
    axes[2].set(xlabel="k", ylabel="evidence recall@k (mean)", title="Retrieval", ylim=(0, 1))
    for ax in axes:
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    if cells:  # a partial run may have no held-out answer yet: nothing to label
        axes[0].legend(fontsize=8)
        axes[1].legend(fontsize=8)
    _save(fig, path)


def plot_footprint(summary: dict, path: Path) -> None:
    """Fact KV per LoCoMo conversation (MiB), with its fact count on each bar."""
    convs = summary["conversations"]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    bars = ax.bar([c["sample"] for c in convs], [c["kv_mib"] for c in convs], color="tab:blue")
    for bar, c in zip(bars, convs):
        ax.annotate(f"{c['facts']} facts", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=8)
    ax.set(ylabel="fact KV (MiB), any w", title=f"KV per conversation ({summary['dtype']}, "
           f"{summary['bytes_per_token']:,} bytes/token)")
    ax.tick_params(axis="x", rotation=30)
    ax.grid(alpha=0.3, axis="y")
    _save(fig, path)


def plot_tiers(summary: dict, path: Path) -> None:
    """Per disk budget (share of the full pool) and eviction policy: fact tokens served as KV
    (with the clairvoyant ceiling), and TTFT p50 / p99."""
    cells = summary["cells"]

    def arm(c: dict) -> str:  # a policy, and when several encoders ran, which
        return c.get("policy", "lru") + (f" / {c.get('encoder', 'eager')}" if len(summary.get("encoders", ())) > 1
                                         else "")
    policies = list(dict.fromkeys(arm(c) for c in cells))
    shares = list(dict.fromkeys(c["share"] for c in cells))
    labels = [f"{s:.0%}" for s in shares]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / (len(policies) + 1)
    ceilings = summary.get("clairvoyant_kv_token_share", {})
    for i, policy in enumerate(policies):
        by_share = {c["share"]: c for c in cells if arm(c) == policy}
        xs = [j + i * width for j in range(len(shares))]
        bars = left.bar(xs, [100 * by_share[s]["kv_token_share"] for s in shares], width, label=policy)
        for bar, s in zip(bars, shares):
            left.annotate(f"{by_share[s]['kv_token_share']:.0%}", (bar.get_x() + bar.get_width() / 2,
                          bar.get_height()), ha="center", va="bottom", fontsize=7)
        right.plot(labels, [1e3 * by_share[s]["ttft_p50_s"] for s in shares], "o-", label=f"{policy} p50")
        right.plot(labels, [1e3 * by_share[s]["ttft_p99_s"] for s in shares], "s--", label=f"{policy} p99")
    if ceilings:
        xs = [j + len(policies) * width for j in range(len(shares))]
        left.bar(xs, [100 * ceilings.get(f"{s:g}", 0) for s in shares], width, color="lightgrey",
                 label="clairvoyant (Belady)")
    left.set_xticks([j + width * len(policies) / 2 for j in range(len(shares))], labels)
    left.set(xlabel="disk budget (share of the full pool)", ylabel="retrieved fact tokens served as KV (%)",
             ylim=(0, 110), title=f"Zipf replay, {summary['users']} users, k={summary['k']}")
    left.legend(fontsize=8, loc="lower left")
    right.set(xlabel="disk budget (share of the full pool)", ylabel="TTFT (ms)", title="TTFT per budget")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3, axis="y")
    _save(fig, path)


def plot_fleet(summary: dict, path: Path) -> None:
    """Left: share of fact tokens served as KV vs the fleet's LRU bytes, per storage dtype, at the
    headline cell. Right: bytes needed for the target vs users, per dtype and user Zipf exponent."""
    st = summary["settings"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"bfloat16": "tab:blue", "int8": "tab:orange", "int4": "tab:green"}
    curve = summary["curve"]
    for dtype in st["dtypes"]:
        ax1.plot([p["bytes"][dtype] / 2**50 for p in curve], [100 * p["kv_share"] for p in curve],
                 color=colors.get(dtype), label=dtype)
    ax1.axhline(100 * st["target"], color="grey", linestyle=":", label=f"target {100 * st['target']:.0f}%")
    head = summary.get("headline", {})
    ax1.set(xlabel="fleet KV cache, all tiers (PiB)", ylabel="fact tokens served as KV (%)",
            title=f"{head.get('users', 0):,} users, k={head.get('k')}, Zipf users {head.get('user_zipf')}, "
                  f"facts {head.get('fact_zipf')}")
    f0, k0 = st["fact_zipfs"][0], st["ks"][0]
    for dtype in st["dtypes"]:
        for s, style in zip(st["user_zipfs"], ("-", "--", ":", "-.")):
            cs = [c for c in summary["cells"] if c["dtype"] == dtype and c["k"] == k0 and c["user_zipf"] == s
                  and c["fact_zipf"] == f0]
            ax2.plot([c["users"] for c in cs], [c["target_depth_bytes"] / 2**40 for c in cs], marker="o",
                     linestyle=style, color=colors.get(dtype), label=f"{dtype}, user Zipf {s}")
    ax2.set(xlabel="users", ylabel="TiB (fleet total)", xscale="log", yscale="log",
            title=f"KV for {100 * st['target']:.0f}% of fact tokens (k={k0}, fact Zipf {f0})")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    _save(fig, path)
