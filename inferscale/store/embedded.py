"""The embedded Chroma store of a data dir, when the memories move to a Chroma server.

A data dir that was used without ``chroma_url`` keeps its memories in ``<data_dir>/chroma``
(Chroma's embedded ``PersistentClient``). Opening it later with ``chroma_url`` would show
the server's memories only, so those would look lost: :class:`~inferscale.memory.Memory`
refuses, naming how many there are (:func:`embedded_count`) and the command that moves
them (``inferscale copy-to-chroma``, :func:`copy_to_server`), unless the user asks to
open the server regardless (``hide_embedded_memories=True``).

The turn log, the history and the KV pool stay in the data dir (or the database) as they
were: a memory keeps its id, so its history and its KV still belong to it on the server.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from inferscale.store.chroma import _COLLECTION, IDS_PER_READ, ChromaServer, FactStore

from inferscale.store.records import StoreError
CHROMA_FILE = "chroma.sqlite3"


def embedded_path(data_dir: Path) -> Path:
    """The embedded store's folder of ``data_dir``."""
    return Path(data_dir) / "chroma"


def embedded_count(data_dir: Path) -> int:
    """How many memories the embedded store of ``data_dir`` holds (0 when it has none, or
    no store at all: then nothing is opened)."""
    path = embedded_path(data_dir)
    if not (path / CHROMA_FILE).is_file():
        return 0
    import chromadb
    from chromadb.config import Settings

    client = chromadb.PersistentClient(path=str(path), settings=Settings(anonymized_telemetry=False))
    try:
        return client.get_collection(_COLLECTION).count()
    except Exception:  # noqa: BLE001 - chromadb's NotFoundError / ValueError: no collection, no memories
        return 0


def hidden_memories_message(data_dir: Path, count: int, chroma_url: str) -> str:
    """The one line that refuses to open ``chroma_url`` over ``data_dir``'s ``count`` embedded memories."""
    return (f"the data dir {data_dir} holds {count} memories in its embedded Chroma store, which chroma_url="
            f"{chroma_url} would hide: move them to the server with `inferscale copy-to-chroma --data-dir "
            f"{data_dir} --chroma-url {chroma_url}`, or set hide_embedded_memories=True "
            "(INFERSCALE_HIDE_EMBEDDED_MEMORIES=1) to use the server without them")


def copy_to_server(data_dir: Path, server: ChromaServer) -> tuple[int, Path | None]:
    """Copy every memory of ``data_dir``'s embedded store into ``server``'s collection (ids,
    texts, embeddings and metadata as they are), check that the server holds each, then move
    the embedded folder aside to ``chroma.copied-<UTC time>`` (kept as a backup).

    Idempotent: memories the server already holds unchanged are not written again, so a
    copy that stopped half-way is finished by running it again.

    Returns:
        ``(memories copied, the backup folder)``; ``(0, None)`` when there was nothing to copy.

    Raises:
        StoreError: the server cannot be reached; or it holds one of these ids with another
            text or metadata (nothing is written then); or a copied memory is missing after
            the copy (the embedded store is left in place).
    """
    path = embedded_path(data_dir)
    if embedded_count(data_dir) == 0:
        return 0, None
    source = FactStore(path)
    rows = source.rows()
    target = FactStore(path, server)
    there = target.rows(ids=rows["ids"])
    held = {i: (d, m) for i, d, m in zip(there["ids"], there["documents"], there["metadatas"])}
    conflicts = [i for i, d, m in zip(rows["ids"], rows["documents"], rows["metadatas"])
                 if i in held and held[i] != (d, m)]
    if conflicts:
        raise StoreError(f"the Chroma server at {server.url} already holds {len(conflicts)} of these memory ids with "
                         f"other contents (e.g. {conflicts[0]}): nothing was copied; use another chroma_collection")
    todo = [j for j, i in enumerate(rows["ids"]) if i not in held]
    for start in range(0, len(todo), IDS_PER_READ):
        part = todo[start:start + IDS_PER_READ]
        target.write_rows([rows["ids"][j] for j in part], rows["embeddings"][part],
                          [rows["documents"][j] for j in part], [rows["metadatas"][j] for j in part])
    landed = set(target.rows(ids=rows["ids"], include=())["ids"])
    missing = [i for i in rows["ids"] if i not in landed]
    if missing:
        raise StoreError(f"{len(missing)} memories did not reach the Chroma server at {server.url} (e.g. "
                         f"{missing[0]}): the embedded store is left as it was; run the copy again")
    del source, target
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    backup = path.with_name(f"chroma.copied-{stamp}")
    path.rename(backup)
    return len(rows["ids"]), backup

