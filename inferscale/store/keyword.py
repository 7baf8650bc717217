"""Keyword (BM25) scoring of a scope's facts and its fusion with the dense ranking.

Dense search misses what embeddings blur: names, dates, rare words ("Caroline", "LGBTQ",
"7 May 2023"). :class:`KeywordIndex` scores a scope's facts with BM25 (``bm25s``'s
scoring and stop words, Snowball stems from ``PyStemmer``, updated per write); :func:`fuse`
merges its ranking with the dense one by reciprocal rank fusion (Cormack, Clarke and
Buettcher, SIGIR 2009: ``score = sum over rankings of 1 / (c + rank)``).

Two more signals join the fusion: a query that names a month or year fuses the ranking of
the memories naming it (:func:`add_date_ranking`), and a memory drawn from within a few
turns of a strong match gets a share of its score (:func:`turn_neighbor_bonus`).

The fusion constant ``c`` is :data:`RRF_C`, chosen on LoCoMo conversations 0-2 by
``inferscale bench retrieval`` (docs/results/retrieval/retrieval.md); every other
conversation is held out.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Sequence

import numpy as np

#: Reciprocal rank fusion constant (ranks counted from 1). The paper's 60 flattens the top of
#: each ranking; on LoCoMo conversations 0-2 (184-324 facts each) evidence recall@10 was
#: 0.640 for c = 1 and 2, 0.638 for 5, 0.631 for 10, 0.586 for 60
#: (docs/results/retrieval/retrieval.md); ties go to the larger, smoother c.
RRF_C = 2
#: Turn-neighbour smoothing (:func:`turn_neighbor_bonus`): a row gets this share of the best
#: fused score among the :data:`NEIGHBOR_SOURCES` best rows drawn from within
#: :data:`NEIGHBOR_TURNS` turns of its own. Chosen on LoCoMo conversations 0-2 only (with
#: the preceding-turn expansion of :meth:`inferscale.store.turns.TurnLog.keyword_docs`):
#: evidence recall@10 0.685 -> 0.698 there, share 0.2-0.5 and reach 2-8 turns all within
#: 0.01 of it (docs/results/retrieval).
NEIGHBOR_SHARE = 0.35
NEIGHBOR_TURNS = 4.0
NEIGHBOR_SOURCES = 64
#: Search modes: ``"hybrid"`` (dense and BM25 fused), ``"dense"`` (cosine only).
SEARCH_MODES = ("hybrid", "dense")

_WORD = re.compile(r"(?u)\b\w\w+\b")  # bm25s.tokenize's default token pattern
_analyzer: tuple | None = None


def tokens(text: str) -> list[str]:
    """BM25 terms of ``text``: lower-cased words of two or more characters, English stop
    words (``bm25s``'s list) removed, Snowball-stemmed; what ``bm25s.tokenize(...,
    stopwords="en", stemmer=...)`` gives, without its per-call overhead (0.007 vs 0.07 ms a
    question), so queries and facts are tokenized the same way."""
    global _analyzer
    if _analyzer is None:
        import Stemmer
        from bm25s.stopwords import STOPWORDS_EN

        _analyzer = (frozenset(STOPWORDS_EN), Stemmer.Stemmer("english"))
    stop, stemmer = _analyzer
    return stemmer.stemWords([w for w in _WORD.findall(text.lower()) if w not in stop])


class KeywordIndex:
    """BM25 over one scope's fact texts, in row order (row ``i`` is the ``i``-th text), kept
    up to date write by write.

    The scores are ``bm25s``'s defaults to the float (its "lucene" method, Kamphuis et al.,
    ECIR 2020: ``idf = ln(1 + (N - df + 0.5) / (df + 0.5))``, term part ``tf / (tf + k1 *
    (1 - b + b * dl / avgdl))``, k1 = 1.5, b = 0.75; a query term counts as often as it
    occurs; ``tests/test_hybrid_search.py`` compares with ``bm25s`` itself), but the index
    is a term -> {row: tf} map updated per write instead of ``bm25s``'s fixed corpus: a
    20,000-fact scope rebuilt in ``bm25s`` took ~400 ms after every write (docs/decisions.md).

    Args:
        texts: the facts' texts, one per row.
    """

    K1 = 1.5
    B = 0.75

    def __init__(self, texts: Sequence[str] = ()) -> None:
        self._empty()
        self.append(texts)

    def _empty(self) -> None:
        self._rows: list[Counter] = []  # row -> term frequencies
        self._lengths: list[int] = []  # row -> length in terms
        self._total = 0  # sum of the lengths
        self._postings: dict[str, dict[int, int]] = {}  # term -> {row: tf}
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # term -> (rows, tfs), built on use
        self._length_array: np.ndarray | None = None

    @property
    def size(self) -> int:
        """How many rows (texts) the index holds."""
        return len(self._rows)

    def append(self, texts: Sequence[str]) -> None:
        """Add ``texts`` as the next rows."""
        for text in texts:
            self._index(len(self._rows), Counter(tokens(text)), new=True)

    def replace(self, row: int, text: str) -> None:
        """Replace row ``row``'s text (``0 <= row < size``)."""
        self._unindex(row)
        self._index(row, Counter(tokens(text)), new=False)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (ascending), renumbered ``0..len(rows)-1`` as the partition's rows
        are after a delete; re-indexed from the kept rows' terms, nothing tokenized again."""
        kept = [self._rows[r] for r in rows]
        self._empty()
        for counts in kept:
            self._index(len(self._rows), counts, new=True)

    def _index(self, row: int, counts: Counter, new: bool) -> None:
        length = sum(counts.values())
        if new:
            self._rows.append(counts)
            self._lengths.append(length)
        else:
            self._rows[row], self._lengths[row] = counts, length
        self._total += length
        self._length_array = None
        for term, tf in counts.items():
            self._postings.setdefault(term, {})[row] = tf
            self._arrays.pop(term, None)

    def _unindex(self, row: int) -> None:
        for term in self._rows[row]:
            posting = self._postings[term]
            del posting[row]
            if not posting:
                del self._postings[term]
            self._arrays.pop(term, None)
        self._total -= self._lengths[row]

    def _array(self, term: str) -> tuple[np.ndarray, np.ndarray]:
        got = self._arrays.get(term)
        if got is None:
            posting = self._postings[term]
            got = (np.fromiter(posting.keys(), dtype=np.int64, count=len(posting)),
                   np.fromiter(posting.values(), dtype=np.float64, count=len(posting)))
            self._arrays[term] = got
        return got

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every row for ``query``: ``[size]`` float32, 0 where no query term occurs."""
        n = len(self._rows)
        out = np.zeros(n, dtype=np.float64)
        known = [t for t in tokens(query) if t in self._postings]
        if not known or n == 0:
            return out.astype(np.float32)
        if self._length_array is None:
            self._length_array = np.asarray(self._lengths, dtype=np.float64)
        norm = self.K1 * (1 - self.B + self.B * self._length_array / (self._total / n))  # [n]
        for term in known:
            rows, tf = self._array(term)
            idf = math.log(1 + (n - len(rows) + 0.5) / (len(rows) + 0.5))
            out[rows] += idf * tf / (tf + norm[rows])
        return out.astype(np.float32)


def fused_scores(dense: np.ndarray, keyword: np.ndarray, c: int = RRF_C) -> np.ndarray:
    """Reciprocal rank fusion scores of a dense and a keyword ranking over the same rows.

    Args:
        dense: ``[n]`` cosine similarities; ``-inf`` marks rows excluded (a filter).
        keyword: ``[n]`` BM25 scores; a row scoring 0 (no query term) has no keyword rank.
        c: the fusion constant (:data:`RRF_C`).

    Returns:
        ``[n]`` float64: ``1 / (c + dense rank)`` plus ``1 / (c + keyword rank)`` where the
        row has one; ``-inf`` for excluded rows.
    """
    n = dense.shape[0]
    eligible = np.isfinite(dense)
    order = np.argsort(-dense, kind="stable")
    dense_rank = np.empty(n, dtype=np.float64)
    dense_rank[order] = np.arange(1, n + 1)
    fused = np.where(eligible, 1.0 / (c + dense_rank), -np.inf)
    hit = (keyword > 0) & eligible
    if hit.any():
        rows = np.flatnonzero(hit)
        by_keyword = rows[np.argsort(-keyword[rows], kind="stable")]
        fused[by_keyword] += 1.0 / (c + np.arange(1, len(by_keyword) + 1))
    return fused


def top_rows(scores: np.ndarray, dense: np.ndarray, k: int) -> np.ndarray:
    """The ``min(k, eligible)`` best rows of ``scores`` ``[n]`` (``-inf``: excluded), ties
    broken by ``dense`` ``[n]`` then by row."""
    n = scores.shape[0]
    return np.lexsort((np.arange(n), -dense, -scores))[: min(k, int(np.isfinite(scores).sum()))]


def fuse(dense: np.ndarray, keyword: np.ndarray, k: int, c: int = RRF_C) -> np.ndarray:
    """Reciprocal rank fusion of a dense and a keyword ranking over the same rows
    (:func:`fused_scores`), top ``k``.

    Args:
        dense: ``[n]`` cosine similarities; ``-inf`` marks rows excluded (a filter).
        keyword: ``[n]`` BM25 scores; a row scoring 0 (no query term) has no keyword rank.
        k: how many rows to return.
        c: the fusion constant (:data:`RRF_C`).

    Returns:
        ``[min(k, eligible)]`` row indices, best first (ties by dense score, then row).
    """
    return top_rows(fused_scores(dense, keyword, c), dense, k)


_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")
_DATE = re.compile(r"\b(" + "|".join(_MONTHS) + r"|(?:19|20)\d\d)\b")  # capitalized months, years 1900-2099


def date_terms(text: str) -> frozenset[str]:
    """The months (capitalized full names, as dates are written: "May", not "may") and years
    (1900-2099) ``text`` mentions: ``"Jo moved on 7 May 2023."`` -> ``{"May", "2023"}``."""
    return frozenset(_DATE.findall(text))


def add_date_ranking(fused: np.ndarray, dense: np.ndarray, rows: np.ndarray, c: int = RRF_C) -> None:
    """Fuse one more ranking into ``fused`` (in place): the rows whose memory mentions every
    month and year the query mentions (``rows``, from :func:`date_terms`), ranked by cosine,
    each adding ``1 / (c + rank)`` as the dense and keyword rankings do.

    "What did Jo do in August 2023?" shares its date with the memories of that month, but
    BM25 barely sees it (a conversation's year is in most memories; "may" is a stop word).
    A ranking of its own has no weight to tune: it counts as the other two do.

    Args:
        fused: ``[n]`` fused scores (:func:`fused_scores`; ``-inf``: excluded, left so).
        dense: ``[n]`` cosine similarities. rows: indices of the rows that match.
        c: the fusion constant (:data:`RRF_C`).
    """
    rows = rows[np.isfinite(fused[rows])]
    if rows.size:
        ranked = rows[np.argsort(-dense[rows], kind="stable")]
        fused[ranked] += 1.0 / (c + np.arange(1, len(ranked) + 1))


def turn_neighbor_bonus(scores: np.ndarray, positions: np.ndarray, order: np.ndarray, *,
                        share: float = NEIGHBOR_SHARE, reach: float = NEIGHBOR_TURNS,
                        sources: int = NEIGHBOR_SOURCES) -> np.ndarray:
    """Each row's share of the best score among the rows drawn from nearby turns.

    A fact drawn from the turns right around a strong match is often the evidence a question
    needs and its words do not repeat ("How did Joanna celebrate after sharing her book?"
    matches the fact about sharing the book; the celebration is two turns later). So a row
    gets ``share`` times the best fused score of the ``sources`` best rows whose turn
    position is within ``reach`` turns of its own (itself excluded).

    Args:
        scores: ``[n]`` fused scores (:func:`fused_scores`; ``-inf`` excluded: such rows
            neither give nor get a bonus).
        positions: ``[n]`` each row's turn position (the mean log position of its source
            turns), ``NaN`` for a row with no logged source turn (no bonus either way).
        order: ``[m]`` the rows with a position, sorted by it (``np.argsort`` of the finite
            positions, as row indices).
        share / reach / sources: :data:`NEIGHBOR_SHARE`, :data:`NEIGHBOR_TURNS` (turns),
            :data:`NEIGHBOR_SOURCES`.

    Returns:
        ``[n]`` float64 bonus, 0 where none.
    """
    n = scores.shape[0]
    bonus = np.zeros(n, dtype=np.float64)
    if order.size == 0 or n == 0:
        return bonus
    finite = np.isfinite(scores)
    eligible = int(finite.sum())
    masked = np.where(finite, scores, -np.inf)
    best = np.argpartition(-masked, sources)[:sources] if eligible > sources else np.flatnonzero(finite)
    best = best[np.isfinite(positions[best])]  # a source needs a turn position
    if best.size == 0:
        return bonus
    placed = positions[order]
    lo = np.searchsorted(placed, positions[best] - reach, side="left")
    hi = np.searchsorted(placed, positions[best] + reach, side="right")
    counts = hi - lo
    # every (source, row within its reach) pair, flattened: no Python loop over the sources
    source = np.repeat(best, counts)
    rows = order[np.repeat(lo - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))]
    keep = (rows != source) & finite[rows]
    np.maximum.at(bonus, rows[keep], share * scores[source[keep]])
    return bonus
