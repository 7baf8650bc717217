"""A store-level embedder for ``InferScaleStore``: LangGraph's ``IndexConfig``, as its stores have it.

``InferScaleStore(memory, index={"dims": 1536, "embed": embeddings, "fields": ["text"]})``
embeds what ``InMemoryStore``, ``SqliteStore`` and ``PostgresStore`` embed: each field path
of a put (the put's ``index`` list, else ``fields``, else the whole value as JSON) gives one
text per match (``"tags[*]"`` gives one per tag), each embedded with ``embed``; a search with a
query scores an item by the best similarity between the query's vector and one of its own
(max pooling), as those stores do: cosine by default, or ``PostgresIndexConfig``'s
``distance_type`` (``"inner_product"``: the dot product; ``"l2"``: minus the Euclidean
distance, PostgresStore's scores). ``PostgresIndexConfig``'s ``ann_index_config`` is taken and
has no effect: InferScaleStore ranks a search's matches exactly, with float32 vectors (no
approximate index, no ``halfvec``). The vectors travel in the item's memory metadata
(:data:`VECTORS`), so every client of the memory, in-process or over HTTP, ranks the same
way. Without ``embed`` the store ranks with InferScale's own hybrid search (docs/adapters.md).
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
from langgraph.store.base import PutOp
from langgraph.store.base.embed import ensure_embeddings, get_text_at_path

logger = logging.getLogger(__name__)

#: the metadata field that holds an item's vectors: ``{"dims": d, "f32": base64 of [m, d] float32}``
VECTORS = "lg_vectors"
#: the keys of LangGraph's ``IndexConfig``, of ``SqliteIndexConfig`` (``text_fields`` is its name
#: for ``fields``) and of ``PostgresIndexConfig`` (``ann_index_config``, ``distance_type``)
INDEX_KEYS = ("dims", "embed", "fields", "text_fields", "distance_type", "ann_index_config")
#: ``distance_type`` -> the score of a vector ``v`` against a query ``q``, as PostgresStore gives it:
#: ``1 - cosine distance``, ``-(negative inner product)``, ``-(L2 distance)`` (langgraph-checkpoint-postgres
#: ``base.py``, ``_get_vector_type_ops`` and its score expressions)
DISTANCES = ("cosine", "inner_product", "l2")
#: ``ann_index_config``'s keys (``ANNIndexConfig``, ``HNSWConfig``, ``IVFFlatConfig``) and its vector types
ANN_KEYS = ("kind", "vector_type", "m", "ef_construction", "lists", "nlist")
ANN_KINDS = ("hnsw", "ivfflat", "flat")
ANN_VECTOR_TYPES = ("vector", "halfvec")


class StoreIndex:
    """One store's ``IndexConfig``: which field paths are embedded, with what, how items rank.

    Args:
        config: ``{"dims": int, "embed": Embeddings | callable | "provider:model", "fields":
            list[str] | None}`` (LangGraph's ``IndexConfig``; ``fields`` defaults to ``["$"]``,
            the whole value as JSON); ``SqliteIndexConfig``'s ``text_fields`` (for ``fields``)
            and ``distance_type`` (``"cosine"``) are taken too.

    Raises:
        TypeError / ValueError: ``config`` is not a dict, has a key other than those, or a
            ``dims`` that is not a positive int, a ``fields`` that is not a list of non-empty
            strings, a ``distance_type`` other than those three, an ``ann_index_config``
            PostgresStore would refuse, or an ``embed`` LangGraph's
            ``ensure_embeddings`` refuses.
    """

    def __init__(self, config: dict) -> None:
        if not isinstance(config, dict):
            raise TypeError(f"index must be LangGraph's IndexConfig dict (dims, embed, fields), got {config!r}")
        unknown = sorted(set(config) - set(INDEX_KEYS))
        if unknown:
            raise ValueError(f"index has unknown keys {unknown}: an IndexConfig has {list(INDEX_KEYS)}")
        dims = config.get("dims")
        if not isinstance(dims, int) or isinstance(dims, bool) or dims <= 0:
            raise ValueError(f"index['dims'] must be the embedder's vector size, a positive int, got {dims!r}")
        distance = config.get("distance_type", "cosine")
        if distance not in DISTANCES:
            raise ValueError(f"index['distance_type'] must be one of {list(DISTANCES)} (PostgresStore's), got "
                             f"{distance!r}")
        ann = config.get("ann_index_config")
        if ann is not None:
            if not isinstance(ann, dict):
                raise TypeError(f"index['ann_index_config'] must be a dict such as {{'vector_type': 'vector'}}, got "
                                f"{type(ann).__name__}")
            unknown_ann = sorted(str(k) for k in ann if k not in ANN_KEYS)
            if unknown_ann:
                raise ValueError(f"index['ann_index_config'] has unknown keys {unknown_ann}: PostgresStore's "
                                 f"ANNIndexConfig has {list(ANN_KEYS)}")
            if ann.get("vector_type", "vector") not in ANN_VECTOR_TYPES:
                raise ValueError(f"index['ann_index_config']['vector_type'] must be one of {list(ANN_VECTOR_TYPES)}, "
                                 f"got {ann.get('vector_type')!r}")
            if str(ann.get("kind", "hnsw")) not in ANN_KINDS:
                raise ValueError(f"index['ann_index_config']['kind'] must be one of {list(ANN_KINDS)}, got "
                                 f"{ann.get('kind')!r}")
            for key in ("m", "ef_construction", "lists", "nlist"):  # integers, as PostgresStore reads them
                if key in ann:
                    try:
                        int(ann[key])
                    except (TypeError, ValueError):
                        raise ValueError(f"index['ann_index_config'][{key!r}] must be an integer, got "
                                         f"{ann[key]!r:.40}") from None
        fields = config.get("fields") or config.get("text_fields") or ["$"]
        if isinstance(fields, str):  # SqliteStore takes one path as a string
            fields = [fields]
        if not isinstance(fields, list) or not all(isinstance(f, str) and f for f in fields):
            raise TypeError(f"index['fields'] must be a list of field paths such as ['text', 'tags[*]'], got {fields!r}")
        embed = config.get("embed")
        if embed is None:
            raise ValueError("index['embed'] is required: an Embeddings object, a function of a list of texts, "
                             "or a 'provider:model' string")
        if not (isinstance(embed, str) or callable(embed) or hasattr(embed, "embed_documents")):
            raise TypeError(f"index['embed'] must be an Embeddings object, a function of a list of texts, or a "
                            f"'provider:model' string, got {type(embed).__name__} {embed!r:.40}")
        self.dims = dims
        self.distance = distance
        self.fields = list(fields)
        self.embeddings = ensure_embeddings(config["embed"])

    def texts(self, op: PutOp) -> list[str]:
        """The texts a put embeds: one per match of each path (``op.index``, else :attr:`fields`);
        none for a delete or a put with ``index=False``."""
        if op.value is None or op.index is False:
            return []
        paths = self.fields if op.index is None else op.index  # [] embeds nothing, as InMemoryStore
        return [t for path in paths for t in get_text_at_path(op.value, path)]  # "$": the value as JSON

    def vectors(self, puts: Sequence[PutOp]) -> list[dict | None]:
        """Each put's vectors as metadata (:data:`VECTORS`'s value), ``None`` for a put with
        nothing to embed; the texts of all the puts go to the embedder in one call.

        Raises:
            ValueError: the embedder gave a vector of another size than ``dims``, or another
                number of vectors than texts.
        """
        texts = [self.texts(op) for op in puts]
        flat = [t for ts in texts for t in ts]
        got = self.embeddings.embed_documents(flat) if flat else []
        vectors = self._matrix(got, len(flat), "the item texts")
        out, start = [], 0
        for ts in texts:
            block = vectors[start:start + len(ts)]
            start += len(ts)
            out.append({"dims": self.dims, "f32": base64.b64encode(block.tobytes()).decode("ascii")} if ts else None)
        return out

    def rank(self, query: str, memories: list[dict]) -> tuple[list[dict], list[dict]]:
        """The memories with vectors, best first, each with its ``score`` (the best cosine of
        the query's vector with one of its own, max pooling; ties keep ``memories``' order),
        and those without (never ranked: put with ``index=False``, or none of the paths had
        text), in ``memories``' order."""
        scored, scoreless, other = [], [], []
        q = self._matrix([self.embeddings.embed_query(query)], 1, "the query")[0]
        for memory in memories:
            stored = memory["metadata"].get(VECTORS)
            if not stored:
                scoreless.append(memory)
                continue
            if stored.get("dims") != self.dims:  # put by a store with another embedder: not comparable
                scoreless.append(memory)
                other.append(memory)
                continue
            block = np.frombuffer(base64.b64decode(stored["f32"]), dtype=np.float32).reshape(-1, self.dims)
            scored.append({**memory, "score": float(self.scores(block, q).max())})
        scored.sort(key=lambda m: -m["score"])  # stable: ties keep the listing's order
        if other:
            first = other[0]["metadata"].get("langgraph", {})
            logger.warning("%d items under this search were embedded with %s dims, not index['dims'] = %d (e.g. "
                           "%s/%s): they are listed unscored; put them again through this store to rank them",
                           len(other), other[0]["metadata"][VECTORS].get("dims"), self.dims,
                           "/".join(first.get("namespace", [])), first.get("key"))
        return scored, scoreless

    def scores(self, block: np.ndarray, q: np.ndarray) -> np.ndarray:
        """The score of each row of ``block`` (``[m, dims]``) against the query ``q``
        (``[dims]``), by :attr:`distance`: cosine similarity (0 for a zero vector), inner
        product, or minus the L2 distance (higher is closer in all three)."""
        block, q = block.astype(np.float64), q.astype(np.float64)  # float32 products of large vectors overflow
        if self.distance == "inner_product":
            return block @ q
        if self.distance == "l2":
            return -np.linalg.norm(block - q, axis=1)
        q = q / (np.linalg.norm(q) or 1.0)
        norms = np.linalg.norm(block, axis=1)
        return block @ q / np.where(norms > 0, norms, 1.0)

    def _matrix(self, vectors: Any, count: int, what: str) -> np.ndarray:
        """``vectors`` as a ``[count, dims]`` float32 matrix of finite numbers.

        Raises:
            ValueError: anything else (not a list of equal-length number lists, another
                count or size, NaN or infinity, a value float32 cannot hold).
        """
        expected = f"expected {count} lists of index['dims'] = {self.dims} numbers"
        try:
            with np.errstate(over="ignore"):
                matrix = np.asarray(list(vectors), dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the embedder gave {type(vectors).__name__} {vectors!r:.60} for {what}: {expected} "
                             f"({exc})") from None
        if count == 0 and matrix.size == 0:
            return np.zeros((0, self.dims), dtype=np.float32)
        if matrix.shape != (count, self.dims):
            raise ValueError(f"the embedder gave vectors of shape {tuple(matrix.shape)} for {what}: {expected}")
        if not np.isfinite(matrix).all():
            raise ValueError(f"the embedder gave a vector with NaN or infinite values (or beyond float32's range) "
                             f"for {what}: nothing was written; check the embedder")
        return matrix
