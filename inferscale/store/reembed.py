"""Re-embed a store's memories with another embedder (``inferscale reembed``).

A collection's embeddings all come from one embedder: a query embedded by another would be
compared with vectors of another space, and answers would quietly get worse. So a store
names its embedder (the data dir's manifest, and the Chroma collection's metadata,
:data:`~inferscale.store.chroma.EMBEDDER_KEY`), and :class:`~inferscale.memory.Memory`
refuses to open it with another (:func:`~inferscale.store.chroma.reembed_message`). This
module moves a store to a new embedder, never leaving it mixed:

1. the collection is marked (:data:`~inferscale.store.chroma.REEMBEDDING_KEY`): from then
   on it is refused, by every process, until the re-embed ends;
2. every memory (id, text, metadata) is embedded again into a new collection
   ``<collection>-reembed``, checked complete;
3. the old collection is dropped and the new one takes its name; the manifest names the new
   embedder.

A re-embed that stops at any point is finished by running it again (step 2 starts over; a
new collection left complete by a stop between the drop and the rename is renamed). Ids,
texts, metadata, the history, the turn log and the KV pool are untouched: KV depends on the
LLM, not the embedder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
from tqdm import tqdm

from inferscale.checks import first_line
from inferscale.store.chroma import (_COLLECTION, EMBEDDER_KEY, REEMBED_SUFFIX, REEMBEDDING_KEY, FactStore,
                                     open_client, has_collection, reembed_command)
from inferscale.store.embedded import check_not_served, read_manifest, write_manifest
from inferscale.store.open_lock import OPEN_LOCK, holder, lock_open, unlock
from inferscale.store.records import SCHEMA_VERSION, StoreError

#: Marks the new collection complete (every memory embedded and counted).
COMPLETE_KEY = "inferscale_reembed_complete"


def reembed(data_dir: Path, server, embedder: str, embed: Callable[[list[str]], np.ndarray], *,
            batch: int = 256, progress: bool = True) -> int:
    """Re-embed every memory of the store of ``data_dir`` (or of ``server``'s collection) with
    ``embedder``.

    The embedded store is locked against every open :class:`~inferscale.memory.Memory` (they
    hold its open lock: :mod:`inferscale.store.open_lock`) and against another
    re-embed. A Chroma server's collection cannot be locked from here: stop every deployment
    that writes it first, as for ``copy-to-chroma``.

    Args:
        data_dir: the data dir (its embedded store, its manifest, its serve lock).
        server: a :class:`~inferscale.store.chroma.ChromaServer`, or ``None`` for the embedded store.
        embedder: the new embedder's name, as ``MemoryConfig.embedder`` will give it.
        embed: texts -> ``[n, dim]`` float32 unit vectors (the new embedder's ``encode``).
        batch: texts per ``embed`` call.
        progress: show a progress bar.

    Returns:
        The number of memories re-embedded (0: the store already used ``embedder``, or holds none).

    Raises:
        StoreError: ``inferscale serve`` holds the data dir, a ``Memory`` has the store open
            or another re-embed runs; the manifest cannot be read; the store cannot be read
            or written (one line; run it again to finish).
    """
    check_not_served(data_dir, "re-embedding its memories")
    path = Path(data_dir) / "chroma"
    where = server.url if server is not None else str(path)
    read_manifest(data_dir)  # a damaged manifest is named before anything changes
    lock = None
    if server is None:
        lock = lock_open(path, "inferscale reembed")
        if lock is None:
            raise StoreError(f"the store at {where} is open in {holder(path)} (a Memory, inferscale serve or "
                             "inferscale mcp) or being re-embedded: close it, then re-embed")
    try:
        return _reembed(data_dir, server, path, where, embedder, embed, batch, progress)
    except StoreError:
        raise
    except Exception as exc:  # noqa: BLE001 - chromadb's and httpx's errors: one line; a rerun finishes it
        raise StoreError(f"the re-embed of {where} stopped ({type(exc).__name__}: {first_line(exc)}): the store is "
                         f"refused until `{reembed_command(embedder, data_dir, server)}` runs to its end") from None
    finally:
        if lock is not None:
            unlock(lock, path / OPEN_LOCK)


def _reembed(data_dir: Path, server, path: Path, where: str, embedder: str, embed, batch: int,
             progress: bool) -> int:
    client = open_client(path, server)
    name = server.collection if server is not None else _COLLECTION
    temp = name + REEMBED_SUFFIX
    if has_collection(client, temp):
        new = client.get_collection(temp)
        meta = new.metadata or {}
        if not meta.get(COMPLETE_KEY):
            client.delete_collection(temp)  # an earlier try's partial copy: the original still holds everything
        else:  # an earlier try stopped around the swap: finish it with the copy's own embedder
            if has_collection(client, name):
                old = client.get_collection(name)
                if REEMBEDDING_KEY not in (old.metadata or {}) and old.count() > 0:
                    raise StoreError(f"the store at {where} holds both {name!r} ({old.count()} memories) and a "
                                     f"finished re-embed {temp!r} ({new.count()}): keep the one you want and delete "
                                     "the other collection by hand; nothing was changed")
                client.delete_collection(name)  # the marked original, copied whole, or an empty stand-in
            label = meta.get(EMBEDDER_KEY, embedder)
            count = _take_name(client, new, name, data_dir, label, new.count())
            if label == embedder:
                return count
    store = FactStore(path, server)
    if store.metadata.get(EMBEDDER_KEY) == embedder and REEMBEDDING_KEY not in store.metadata:
        _record(data_dir, embedder)
        return 0
    _record(data_dir, reembedding=embedder)  # refused here and everywhere from now until the end
    store.set_metadata(**{REEMBEDDING_KEY: embedder})
    rows = store.rows(include=("documents", "metadatas"))
    new = client.create_collection(temp, metadata={"hnsw:space": "cosine", "inferscale_schema": SCHEMA_VERSION,
                                                   EMBEDDER_KEY: embedder})
    ids, docs, metas = rows["ids"], rows["documents"], rows["metadatas"]
    step = min(batch, int(client.get_max_batch_size()))
    with tqdm(total=len(ids), desc=f"re-embed with {embedder}", unit="memory", disable=not progress) as bar:
        for start in range(0, len(ids), step):
            part = slice(start, start + step)
            vectors = np.asarray(embed(list(docs[part])), dtype=np.float32)
            new.add(ids=list(ids[part]), embeddings=vectors, documents=list(docs[part]),
                    metadatas=list(metas[part]))
            bar.update(len(ids[part]))
    if new.count() != len(ids):
        raise StoreError(f"the re-embed of {where} wrote {new.count()} of {len(ids)} memories: the store is refused "
                         f"until `{reembed_command(embedder, data_dir, server)}` runs to its end")
    new.modify(metadata={"inferscale_schema": SCHEMA_VERSION, EMBEDDER_KEY: embedder, COMPLETE_KEY: True})
    client.delete_collection(name)
    return _take_name(client, new, name, data_dir, embedder, len(ids))


def _take_name(client, new, name: str, data_dir: Path, embedder: str, count: int) -> int:
    """Give the complete new collection the store's name and the manifest its embedder."""
    new.modify(name=name)
    client.get_collection(name).modify(metadata={"inferscale_schema": SCHEMA_VERSION, EMBEDDER_KEY: embedder})
    _record(data_dir, embedder)
    return count


def _record(data_dir: Path, embedder: str | None = None, *, reembedding: str | None = None) -> None:
    """Name ``embedder`` in the data dir's manifest and end its re-embed, or note a re-embed to
    ``reembedding`` under way (written whole, then renamed)."""
    manifest = read_manifest(data_dir)
    if manifest is None:
        return
    if reembedding is not None:
        manifest[REEMBEDDING_KEY] = reembedding
    else:
        manifest["embedder"] = embedder
        manifest.pop(REEMBEDDING_KEY, None)
    write_manifest(data_dir, manifest)
