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
import json
from pathlib import Path

from inferscale.checks import first_line
from inferscale.store import serve_lock
from inferscale.store.chroma import _COLLECTION, ChromaServer, FactStore
from inferscale.store.records import StoreError

#: The data dir's manifest (schema version, embedder; where its memories moved).
MANIFEST = "inferscale.json"

#: Chroma's database file inside an embedded store's folder.
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


def copy_to_server(data_dir: Path, server: ChromaServer) -> tuple[int, int, Path | None]:
    """Copy every memory of ``data_dir``'s embedded store into ``server``'s collection (ids,
    texts, embeddings and metadata as they are), check that the server holds each, note the
    move in the data dir's manifest (so the data dir is not opened without ``chroma_url``
    again), then move the embedded folder aside to ``chroma.copied-<UTC time>`` (a backup).

    Idempotent: memories the server already holds unchanged are not written again, so a
    copy that stopped half-way is finished by running it again.

    Returns:
        ``(memories written, memories the server already held, the backup folder)``;
        ``(0, 0, None)`` when there was nothing to copy.

    Raises:
        StoreError: ``inferscale serve`` holds the data dir; the embedded store or the
            server cannot be read or written (one line; the embedded store is left in
            place); the server holds one of these ids with other contents (nothing is
            written then); a copied memory is missing after the copy.
    """
    path = embedded_path(data_dir)
    check_not_served(data_dir)
    _check_not_reembedding(data_dir)
    try:
        if embedded_count(data_dir) == 0:
            return 0, 0, None
        rows = FactStore(path).rows()
        target = FactStore(path, server)
        there = target.rows(ids=rows["ids"])
        held = {i: (d, m) for i, d, m in zip(there["ids"], there["documents"], there["metadatas"])}
        conflicts = [i for i, d, m in zip(rows["ids"], rows["documents"], rows["metadatas"])
                     if i in held and held[i] != (d, m)]
        if conflicts:
            raise StoreError(f"the Chroma server at {server.url} already holds {len(conflicts)} of these memory ids "
                             f"with other contents (e.g. {conflicts[0]}) in collection {server.collection!r}: nothing "
                             "was copied; copy into another collection (INFERSCALE_CHROMA_COLLECTION)")
        todo = [j for j, i in enumerate(rows["ids"]) if i not in held]
        target.write_rows([rows["ids"][j] for j in todo], rows["embeddings"][todo],
                          [rows["documents"][j] for j in todo], [rows["metadatas"][j] for j in todo])
        landed = set(target.rows(ids=rows["ids"], include=())["ids"])
    except StoreError:
        raise
    except Exception as exc:  # noqa: BLE001 - chromadb's and httpx's errors: one line, nothing moved
        raise StoreError(f"the copy from {path} to the Chroma server at {server.url} stopped ({type(exc).__name__}: "
                         f"{first_line(exc)}): the embedded store is left as it was; run the copy again") from None
    missing = [i for i in rows["ids"] if i not in landed]
    if missing:
        raise StoreError(f"{len(missing)} memories did not reach the Chroma server at {server.url} (e.g. "
                         f"{missing[0]}): the embedded store is left as it was; run the copy again")
    stamp = dt.datetime.now(dt.timezone.utc)
    backup = path.with_name(f"chroma.copied-{stamp.strftime('%Y%m%dT%H%M%SZ')}")
    record_move(data_dir, server.url, stamp.isoformat(timespec="seconds"))
    path.rename(backup)
    return len(todo), len(rows["ids"]) - len(todo), backup


def check_not_served(data_dir: Path, doing: str = "copying its memories") -> None:
    """Refuse while an ``inferscale serve`` holds the data dir (:mod:`inferscale.store.serve_lock`)."""
    try:
        serve_lock.check_free(data_dir)
    except serve_lock.DataDirServed as exc:
        raise StoreError(f"{exc}: stop it before {doing}") from None


def _check_not_reembedding(data_dir: Path) -> None:
    """Refuse a store whose re-embed has not ended (``inferscale reembed``): its memories may
    sit in the re-embed's copy, not where a copy would read them."""
    from inferscale.store.chroma import REEMBEDDING_KEY

    try:
        marked = REEMBEDDING_KEY in (read_manifest(data_dir) or {})
    except StoreError:
        marked = False  # a damaged manifest is named when the store opens
    if marked:
        raise StoreError(f"a re-embed of the memories of {data_dir} has not ended: finish it (`inferscale reembed`, "
                         "as the store's error says) before copying them")


def read_manifest(data_dir: Path) -> dict | None:
    """The data dir's manifest (``None`` when it has none): the one reader of
    :data:`MANIFEST`, for opening a store, a re-embed and a copy.

    Raises:
        StoreError: it cannot be read or is not a JSON object (naming the file and the fix).
    """
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise StoreError(f"the manifest {path} cannot be read ({type(exc).__name__}: {first_line(exc)}): restore it "
                         "from a backup, or delete it to let the next open write a new one") from None
    if not isinstance(manifest, dict):
        raise StoreError(f"the manifest {path} is not a JSON object: restore it from a backup, or delete it to let "
                         "the next open write a new one")
    return manifest


def write_manifest(data_dir: Path, manifest: dict) -> None:
    """Write the data dir's manifest whole, then rename it into place (a reader never sees half)."""
    path = Path(data_dir) / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(path)


#: The manifest field that says where a data dir's memories went (``inferscale copy-to-chroma``).
MOVED_TO = "memories_moved_to"


def record_move(data_dir: Path, url: str, when: str) -> None:
    """Note in ``data_dir``'s manifest that its memories now live on the Chroma server ``url``."""
    manifest = read_manifest(data_dir) or {}
    manifest[MOVED_TO] = {"chroma_url": url, "at": when}
    write_manifest(data_dir, manifest)


def moved_message(data_dir: Path, manifest: dict) -> str | None:
    """The one line that refuses to open ``data_dir`` without ``chroma_url`` after its memories
    moved to a server (``None`` when they did not)."""
    moved = manifest.get(MOVED_TO)
    if not isinstance(moved, dict):
        return None
    url = moved.get("chroma_url", "?")
    return (f"the memories of {data_dir} were moved to the Chroma server at {url} (inferscale copy-to-chroma, "
            f"{moved.get('at', '?')}): open it with chroma_url={url} (INFERSCALE_CHROMA_URL)")
