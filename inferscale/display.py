"""Rich HTML for Jupyter: what a :class:`~inferscale.types.Generation`, a search result and a
:class:`~inferscale.Memory` show when a notebook displays them (their ``_repr_html_``).

Every value from a memory store is user content (memory text, metadata, ids): each passes
through :func:`html.escape` before it reaches the markup, so a memory whose text is a
``<script>`` renders as that text. The markup uses inline styles only (no scripts, nothing
fetched), so it renders the same in JupyterLab, VS Code and a static nbconvert page.
"""

from __future__ import annotations

import html
from typing import Iterable, Sequence

_KV = "#2e7d32"  # injected KV
_TEXT = "#e65100"  # prefilled as text
_QUESTION = "#546e7a"  # the rest of the prompt: question, template
_BOX = "font-family: system-ui, sans-serif; font-size: 13px; line-height: 1.4; max-width: 60em"
_CELL = "padding: 2px 8px; text-align: left; vertical-align: top; border-bottom: 1px solid #ddd"


def esc(value: object) -> str:
    """``value`` as text, escaped for HTML (quotes too: safe inside attributes)."""
    return html.escape(str(value), quote=True)


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], raw: Sequence[int] = ()) -> str:
    """An HTML table of ``rows``, every cell escaped except the columns listed in ``raw``
    (markup this module made itself)."""
    head = "".join(f'<th style="{_CELL}">{esc(h)}</th>' for h in headers)
    body = "".join("<tr>" + "".join(f'<td style="{_CELL}">{c if i in raw else esc(c)}</td>' for i, c in enumerate(r))
                   + "</tr>" for r in rows)
    return f'<table style="border-collapse: collapse"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _bar(parts: Sequence[tuple[str, int, str]]) -> str:
    """A horizontal bar of ``(label, tokens, colour)`` parts, widths proportional to tokens."""
    total = sum(n for _, n, _ in parts) or 1
    cells = "".join(f'<div title="{esc(label)}: {n} tokens" style="width: {100 * n / total:.2f}%; background: {colour};'
                    f' color: white; white-space: nowrap; overflow: hidden; padding: 2px 4px; box-sizing: border-box">'
                    f'{esc(label)} ({n})</div>' for label, n, colour in parts if n > 0)
    return f'<div style="display: flex; width: 100%; margin: 4px 0">{cells}</div>'


def _bytes(n: float | None) -> str:
    if n is None:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _ms(seconds: float | None) -> str:
    return "unknown" if not isinstance(seconds, (int, float)) else f"{seconds * 1000:.1f} ms"


def generation_html(g) -> str:
    """A :class:`~inferscale.types.Generation`: the answer, the prompt's layout (tokens injected
    as KV, tokens prefilled) with TTFT, and each memory in prompt order with where it came from
    (its KV's tier, or text and why)."""
    by_id = {m["id"]: m for m in g.memories}
    if g.mode == "inject":  # the prompt: memories with KV first, then text, each best-ranked last
        order = [i for i in reversed(g.kv_memory_ids)] + [i for i in reversed(g.text_memory_ids)]
    else:
        order = [m["id"] for m in reversed(g.memories)]
    rows = []
    for i in order:
        m = by_id.get(i, {"memory": "", "score": None})
        how = g.kv_sources.get(i, "text (text mode)" if g.mode == "text" else "")
        kind = "KV" if i in g.kv_memory_ids else "text"
        colour = _KV if kind == "KV" else _TEXT
        rows.append((f'<span style="color: {colour}; font-weight: 600">{kind}</span>', how, m.get("memory", ""),
                     "" if m.get("score") is None else f"{m['score']:.3f}"))
    layout = _bar([("memory as KV", g.num_injected_tokens, _KV),
                   ("prefilled", g.num_prefilled_tokens, _TEXT if g.text_memory_ids or g.mode == "text" else _QUESTION)])
    facts = table(["as", "source", "memory (prompt order)", "score"], rows, raw=(0,)) if rows else "<p>no memories</p>"
    return (f'<div style="{_BOX}"><p><b>Answer</b> ({esc(g.mode)} mode): {esc(g.text)}</p>'
            f"<p>TTFT {_ms(g.ttft_s)}; {g.num_prompt_tokens} prompt tokens: {g.num_injected_tokens} injected "
            f"as KV, {g.num_prefilled_tokens} prefilled; retrieval {_ms(g.retrieval_s)}; "
            f"{g.num_generated_tokens} tokens generated</p>{layout}{facts}</div>")


def search_html(results: Sequence[dict], query: str | None = None, mode: str | None = None) -> str:
    """A search result: its ranking (rank, cosine score, memory, metadata)."""
    rows = [(rank, "" if r.get("score") is None else f"{r['score']:.3f}", r.get("memory", ""),
             "" if not r.get("metadata") else r["metadata"]) for rank, r in enumerate(results, 1)]
    title = f"Search {esc(repr(query))}" if query is not None else "Search results"
    how = f" ({esc(mode)} ranking; score = cosine similarity)" if mode else ""
    return (f'<div style="{_BOX}"><p><b>{title}</b>{how}: {len(rows)} result{"s" if len(rows) != 1 else ""}</p>'
            + table(["rank", "score", "memory", "metadata"], rows) + "</div>")


def memory_html(scopes: Sequence[dict], stats: dict, budgets: dict, data_dir: object) -> str:
    """A :class:`~inferscale.Memory`: its scopes with their memory counts, and its KV pool
    (bytes per tier against budgets, memories served as KV and as text)."""
    scope_rows = [(", ".join(f"{k}={s[k]}" for k in ("user_id", "agent_id", "run_id") if k in s), s["memories"],
                   s["updated_at"]) for s in scopes]
    tiers = [(tier, _bytes(stats.get(f"{tier}_bytes")),
              "no limit" if budgets.get(tier) is None else _bytes(budgets[tier]),
              stats.get(f"served_{tier}", 0), stats.get(f"{tier}_evictions", 0)) for tier in ("device", "host", "disk")]
    served = sum(stats.get(f"served_{t}", 0) for t in ("device", "host", "disk", "redis"))
    text = stats.get("served_text", 0)
    share = f"{served / (served + text):.0%}" if served + text else "none yet"
    return (f'<div style="{_BOX}"><p><b>InferScale Memory</b> at {esc(data_dir)}: {len(scopes)} '
            f'scope{"s" if len(scopes) != 1 else ""}</p>'
            + (table(["scope", "memories", "last write"], scope_rows) if scope_rows else "<p>no memories yet</p>")
            + f"<p><b>KV pool</b>: memories served as KV {served}, as text {text} (KV share {share})</p>"
            + table(["tier", "holds", "budget", "served as KV", "evictions"], tiers) + "</div>")
