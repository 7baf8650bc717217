"""Keyword (BM25) scoring of a scope's facts and its fusion with the dense ranking.

Dense search misses what embeddings blur: names, dates, rare words ("Caroline", "LGBTQ",
"7 May 2023"). :class:`KeywordIndex` scores a scope's facts with BM25 (the ``bm25s``
library; English stop words removed, Snowball stems from ``PyStemmer``); :func:`fuse`
merges its ranking with the dense one by reciprocal rank fusion (Cormack, Clarke and
Buettcher, SIGIR 2009: ``score = sum over rankings of 1 / (c + rank)``).

The fusion constant ``c`` is :data:`RRF_C`, chosen on LoCoMo conversations 0-2 by
``inferscale bench retrieval`` (docs/results/retrieval/retrieval.md); every other
conversation is held out.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np

#: Reciprocal rank fusion constant (ranks counted from 1). The paper's 60 flattens the top of
#: each ranking; on LoCoMo conversations 0-2 (184-324 facts each) evidence recall@10 was
#: 0.640 for c = 1 and 2, 0.638 for 5, 0.631 for 10, 0.585 for 60
#: (docs/results/retrieval/retrieval.md); ties go to the larger, smoother c.
RRF_C = 2
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
    """BM25 over one scope's fact texts, in row order (row ``i`` is ``texts[i]``).

    Built whole from the texts (``bm25s`` indexes a fixed corpus); the owner rebuilds it
    after the scope changes, on the next keyword search.

    Args:
        texts: the facts' texts, one per row.
    """

    def __init__(self, texts: Sequence[str]) -> None:
        import bm25s

        self.size = len(texts)
        self._bm25 = None
        if texts:
            self._bm25 = bm25s.BM25()
            self._bm25.index([tokens(t) for t in texts], show_progress=False)

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every row for ``query``: ``[size]`` float32, 0 where no query term occurs."""
        if self._bm25 is None:
            return np.zeros(0, dtype=np.float32)
        known = [t for t in tokens(query) if t in self._bm25.vocab_dict]
        if not known:
            return np.zeros(self.size, dtype=np.float32)
        return np.asarray(self._bm25.get_scores(known), dtype=np.float32)


def fuse(dense: np.ndarray, keyword: np.ndarray, k: int, c: int = RRF_C) -> np.ndarray:
    """Reciprocal rank fusion of a dense and a keyword ranking over the same rows.

    Args:
        dense: ``[n]`` cosine similarities; ``-inf`` marks rows excluded (a filter).
        keyword: ``[n]`` BM25 scores; a row scoring 0 (no query term) has no keyword rank.
        k: how many rows to return.
        c: the fusion constant (:data:`RRF_C`).

    Returns:
        ``[min(k, eligible)]`` row indices, best first (ties by dense score, then row).
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
    top = np.lexsort((np.arange(n), -dense, -fused))[: min(k, int(eligible.sum()))]
    return top
