"""Chroma mirror of the facts: the system of record.

Every acknowledged fact is in Chroma (``chromadb.PersistentClient`` under
``<data_dir>/chroma``) before it is anywhere else; the device index and the KV pool are
rebuilt from it, one scope at a time (:meth:`FactStore.load_scope`). Records carry the fact text, its
embedding and flat metadata: the scope fields, the text hash, the provenance (source
turn ids, JSON) and the user's metadata (JSON).
"""

from __future__ import annotations

import logging
import shlex
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from inferscale.checks import first_line
from inferscale.store import open_lock
from inferscale.store.records import SCHEMA_VERSION, FactRecord, Scope, StoreError

log = logging.getLogger(__name__)

_COLLECTION = "inferscale_memories"
#: Ids per Chroma read. Chroma's SQLite binds one variable per id and refuses more than
#: 32,766 (SQLite's SQLITE_MAX_VARIABLE_NUMBER since 3.32), so a scope of 33,000 facts could
#: not be loaded in one ``get``; reads of more ids go in chunks of this many.
IDS_PER_READ = 10_000
#: Collection metadata: the embedder that built the collection's embeddings.
EMBEDDER_KEY = "inferscale_embedder"
#: Collection metadata: a re-embed to this embedder is under way (``inferscale reembed``).
REEMBEDDING_KEY = "inferscale_reembedding"
#: The collection a re-embed writes into (``<collection><suffix>``) before it takes the name.
REEMBED_SUFFIX = "-reembed"
def reembed_command(embedder: str, data_dir: Path, server: "ChromaServer | None" = None) -> str:
    """The ``inferscale reembed`` command line for a store, quoted for a shell."""
    where = f"--chroma-url {shlex.quote(server.url)}" if server is not None else f"--data-dir {shlex.quote(str(data_dir))}"
    return f"inferscale reembed --embedder {shlex.quote(embedder)} {where}"


def reembed_message(where: str, found: str, wanted: str, command: str) -> str:
    """The one line that refuses a store built with embedder ``found`` when ``wanted`` is set
    (``command``: :func:`reembed_command` for ``wanted``)."""
    return (f"the memories at {where} were embedded with {found!r}, not {wanted!r}: re-embed them with "
            f"`{command}`, or open the store with embedder={found!r}")


def open_client(path: Path, server: "ChromaServer | None"):
    """A Chroma client: the server's, or the embedded one in ``path`` (created when missing)."""
    import chromadb
    from chromadb.config import Settings

    if server is not None:
        from inferscale.runtime.outages import OUTAGES

        client = server.client()
        OUTAGES.register_probe("chroma", client.heartbeat)
        return client
    path.mkdir(parents=True, exist_ok=True)
    return chromadb.PersistentClient(path=str(path), settings=Settings(anonymized_telemetry=False))


def _check_not_served(data_dir: Path) -> None:
    """Refuse to open an embedded store whose data dir an ``inferscale serve`` or ``inferscale
    mcp`` of another process writes (:mod:`inferscale.store.serve_lock`): two writers of one
    Chroma folder corrupt each other's view of it (the server then answers 500s).

    Raises:
        StoreError: naming the server's pid and the ways out.
    """
    from inferscale.store import serve_lock

    try:
        serve_lock.check_free(data_dir, own_ok=True)
    except serve_lock.DataDirServed as exc:
        raise StoreError(f"{exc}, and it is this data dir's one writer: reach its memories over HTTP "
                         f"(docs/server.md), stop it, or give Memory another data_dir") from None


def has_collection(client, name: str) -> bool:
    """Whether ``client`` holds a collection called ``name``."""
    try:
        client.get_collection(name)
    except Exception:  # noqa: BLE001 - chromadb's NotFoundError / ValueError
        return False
    return True


@dataclass(frozen=True)
class ChromaServer:
    """Where a Chroma server is (``chroma run``), and how to authenticate to it.

    Attributes:
        url: ``http://host:port`` or ``https://host:port``.
        headers: HTTP headers sent with every request (e.g. a proxy's auth header).
        auth_token: a token for Chroma's token authentication (``Authorization: Bearer``,
            Chroma's ``TokenAuthClientProvider``), or ``None``.
        tenant / database: Chroma's tenant and database.
        collection: the collection holding the facts (one per deployment: stores with
            different embedders must not share one).
    """

    url: str
    headers: dict[str, str] | None = None
    auth_token: str | None = None
    tenant: str = "default_tenant"
    database: str = "default_database"
    collection: str = _COLLECTION

    def client(self):
        """A ``chromadb.HttpClient`` for this server.

        Raises:
            StoreError: the server does not answer, or refuses the credentials.
        """
        import chromadb
        from chromadb.config import Settings

        from inferscale.runtime.outages import OUTAGES

        OUTAGES.register("chroma", self.url)  # its connection errors read as a Chroma outage
        parts = urlsplit(self.url)
        settings = Settings(anonymized_telemetry=False)
        if self.auth_token:
            settings = Settings(anonymized_telemetry=False,
                                chroma_client_auth_provider="chromadb.auth.token_authn.TokenAuthClientProvider",
                                chroma_client_auth_credentials=self.auth_token)
        try:
            return chromadb.HttpClient(host=parts.hostname or "localhost",
                                       port=parts.port or (443 if parts.scheme == "https" else 8000),
                                       ssl=parts.scheme == "https", headers=self.headers, settings=settings,
                                       tenant=self.tenant, database=self.database)
        except Exception as exc:  # noqa: BLE001 - chromadb raises ValueError, httpx errors, auth errors
            raise StoreError(f"cannot reach the Chroma server at {self.url} ({type(exc).__name__}: "
                             f"{first_line(exc)}): start it (`chroma run --path DIR "
                             "--port PORT`) or check chroma_url and its credentials") from None


class FactStore:
    """Facts in a Chroma database: embedded in ``path`` (default) or on a Chroma server.

    Args:
        path: folder of the embedded Chroma database (created when missing; unused with ``server``).
        server: a Chroma server to use instead (:class:`ChromaServer`).
        embedder: the embedder this process embeds with: a collection built with another is
            refused (:func:`reembed_message`), one that names none is marked with it, a new one
            is created with it (``None``: no check, for copies and re-embeds).

    Raises:
        StoreError: the folder cannot be created or written, the server cannot be reached,
            the store was written by an incompatible schema version, with another embedder,
            or a re-embed of it stopped half-way.
    """

    def __init__(self, path: Path, server: ChromaServer | None = None, embedder: str | None = None) -> None:
        where = server.url if server is not None else str(path)
        self._server = server
        self.name = server.collection if server is not None else _COLLECTION
        self._data_dir = Path(path).parent  # the data dir of <data_dir>/chroma
        self._open_lock = None
        if server is None and embedder is not None:  # a Memory's store: one process at a time, no re-embed under it
            _check_not_served(self._data_dir)  # a server there is named as such
            self._open_lock = open_lock.hold(path)
        try:
            self._open(path, server, embedder, where)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the Chroma client, then end this store's hold of the embedded store's open lock
        (:mod:`inferscale.store.open_lock`): with the process's last store closed, another
        process or a re-embed may open it. Chroma keeps one system a folder for the whole
        process until its last client closes; left running, it would serve a later store of
        this process its stale view of a folder another process wrote meanwhile ("Error
        finding id")."""
        client, self._client = getattr(self, "_client", None), None
        if client is not None and self._server is None:
            try:
                client.close()
            except Exception as exc:  # noqa: BLE001 - closing must not fail a Memory's close
                log.warning("closing the embedded Chroma client failed: %s", exc)
        if self._open_lock is not None:
            open_lock.release(self._open_lock)
            self._open_lock = None

    def _open(self, path: Path, server: ChromaServer | None, embedder: str | None, where: str) -> None:
        try:
            self._client = open_client(path, server)
            temp = self.name + REEMBED_SUFFIX
            if embedder is not None and has_collection(self._client, temp) \
                    and not has_collection(self._client, self.name):  # a re-embed stopped before renaming
                label = (self._client.get_collection(temp).metadata or {}).get(EMBEDDER_KEY, embedder)
                raise StoreError(f"a re-embed of the memories at {where} stopped half-way: run "
                                 f"`{reembed_command(label, path.parent, server)}` again to finish it")
            metadata = {"hnsw:space": "cosine", "inferscale_schema": SCHEMA_VERSION}
            self._col = self._client.get_or_create_collection(
                self.name, metadata=metadata if embedder is None else {**metadata, EMBEDDER_KEY: embedder})
        except PermissionError as exc:
            raise StoreError(f"cannot write the memory store at {path}: {exc}. Choose a writable data_dir.") from exc
        except StoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - a server that answers but refuses (auth, tenant)
            if server is None:
                raise
            raise StoreError(f"the Chroma server at {server.url} refused the collection {server.collection!r} "
                             f"({type(exc).__name__}: {first_line(exc)}): check "
                             "chroma_auth_token, chroma_headers, tenant and database") from None
        version = (self._col.metadata or {}).get("inferscale_schema", SCHEMA_VERSION)
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"the store at {where} has schema version {version}, newer than this InferScale's "
                f"{SCHEMA_VERSION}: upgrade inferscale"
            )
        self._lock = threading.Lock()
        self._max_batch: int | None = None
        if embedder is not None:
            self._check_embedder(embedder, where)

    @property
    def metadata(self) -> dict:
        """The collection's own metadata (schema version, embedder, a re-embed under way)."""
        return dict(self._col.metadata or {})

    def set_metadata(self, **fields: object) -> None:
        """Set (or, with ``None``, drop) fields of the collection's metadata; the distance
        function, fixed at creation, is left alone."""
        meta = {k: v for k, v in self.metadata.items() if not k.startswith("hnsw:")}
        meta.update(fields)
        self._col.modify(metadata={k: v for k, v in meta.items() if v is not None})

    def _check_embedder(self, embedder: str, where: str) -> None:
        meta = self.metadata
        data_dir = self._data_dir
        if REEMBEDDING_KEY in meta:
            raise StoreError(f"a re-embed of the memories at {where} with {meta[REEMBEDDING_KEY]!r} stopped half-way: "
                             f"run `{reembed_command(meta[REEMBEDDING_KEY], data_dir, self._server)}` again to finish it")
        found = meta.get(EMBEDDER_KEY)
        if found is None:  # built before collections named their embedder: the data dir's manifest vouched for it
            self.set_metadata(**{EMBEDDER_KEY: embedder})
        elif found != embedder:
            raise StoreError(reembed_message(where, found, embedder, reembed_command(embedder, data_dir, self._server)))

    @property
    def max_batch(self) -> int:
        """Most rows Chroma takes in one write (``get_max_batch_size``: 5,461 with its SQLite
        backend, embedded or server)."""
        if self._max_batch is None:
            self._max_batch = int(self._client.get_max_batch_size())
        return self._max_batch

    def add(self, records: list[FactRecord], embeddings: np.ndarray) -> None:
        """Write ``records`` with their ``embeddings`` (``[n, dim]`` float32), in batches of at
        most :attr:`max_batch` rows; when a batch fails, the batches written before it are
        deleted again and the error is raised (all or nothing, as far as Chroma allows)."""
        ids = [r.id for r in records]
        with self._lock:
            for start in range(0, len(records), self.max_batch):
                part = records[start:start + self.max_batch]
                try:
                    self._col.add(ids=ids[start:start + len(part)],
                                  embeddings=embeddings[start:start + len(part)].astype(np.float32),
                                  documents=[r.text for r in part], metadatas=[r.to_chroma_metadata() for r in part])
                except BaseException:
                    if start:
                        self._col.delete(ids=ids[:start])
                    raise

    def update(self, records: list[FactRecord], embeddings: np.ndarray) -> None:
        """Replace stored records' texts, metadata and embeddings (``[n, dim]`` float32), in
        writes of at most :attr:`max_batch` rows (one write for most batches)."""
        with self._lock:
            for start in range(0, len(records), self.max_batch):
                part = records[start:start + self.max_batch]
                self._col.update(ids=[r.id for r in part],
                                 embeddings=embeddings[start:start + len(part)].astype(np.float32),
                                 documents=[r.text for r in part], metadatas=[r.to_chroma_metadata() for r in part])

    def update_metadata(self, records: list[FactRecord]) -> None:
        """Replace stored records' metadata (their user metadata and timestamps) alone: the
        texts and the embeddings stay as stored, nothing is embedded; writes of at most
        :attr:`max_batch` rows."""
        with self._lock:
            for start in range(0, len(records), self.max_batch):
                part = records[start:start + self.max_batch]
                self._col.update(ids=[r.id for r in part], metadatas=[r.to_chroma_metadata() for r in part])

    def delete(self, ids: list[str]) -> None:
        """Delete records by id (in batches of at most :attr:`max_batch`)."""
        with self._lock:
            for start in range(0, len(ids), self.max_batch):
                self._col.delete(ids=ids[start:start + self.max_batch])

    def delete_everything(self) -> None:
        """Delete every record (``Memory.reset``)."""
        with self._lock:
            ids = self._col.get(include=[])["ids"]
            for start in range(0, len(ids), self.max_batch):
                self._col.delete(ids=ids[start:start + self.max_batch])

    def _get(self, include: list[str], ids: list[str] | None = None, where: dict | None = None) -> dict:
        """Chroma's ``get`` by ``ids`` or by ``where``, in reads of at most :data:`IDS_PER_READ`
        ids: ``{"ids", and each of include}`` as lists (embeddings ``[n, dim]`` float32)."""
        if ids is None:  # one read when the answer fits, else its ids first, then by id
            got = self._col.get(where=where, include=include, limit=IDS_PER_READ + 1)
            if len(got["ids"]) <= IDS_PER_READ:
                return self._lists(got, include)
            ids = self._col.get(where=where, include=[])["ids"]
        parts = [self._lists(self._col.get(ids=ids[i: i + IDS_PER_READ], include=include), include)
                 for i in range(0, len(ids), IDS_PER_READ)] or [self._lists({"ids": []}, include)]
        out = {key: [v for part in parts for v in part[key]] for key in ("ids", *include) if key != "embeddings"}
        if "embeddings" in include:  # a chunk whose ids are all gone has no rows and no width
            filled = [part["embeddings"] for part in parts if part["ids"]]
            out["embeddings"] = np.concatenate(filled) if filled else np.zeros((0, 0), dtype=np.float32)
        return out

    @staticmethod
    def _lists(got: dict, include: list[str]) -> dict:
        out = {"ids": list(got["ids"])}
        for key in include:
            if key == "embeddings":
                emb = got.get("embeddings")
                out[key] = np.asarray(emb, dtype=np.float32) if emb is not None and len(got["ids"]) \
                    else np.zeros((0, 0), dtype=np.float32)
            else:
                out[key] = list(got.get(key) or [])
        return out

    def get(self, scope: Scope, ids: list[str]) -> list[FactRecord]:
        """The records of ``ids`` that belong to ``scope`` (others are absent), in ``ids`` order."""
        if not ids:
            return []
        got = self._get(["documents", "metadatas"], ids=list(ids))
        by_id = {
            i: FactRecord.from_chroma(i, d, m)
            for i, d, m in zip(got["ids"], got["documents"], got["metadatas"])
            if m.get("scope") == scope.key
        }
        return [by_id[i] for i in ids if i in by_id]

    @property
    def shared(self) -> bool:
        """Whether other processes may write this store (a Chroma server)."""
        return self._server is not None

    def find_hashes(self, scope: Scope, hashes: list[str]) -> list[FactRecord]:
        """The records of ``scope`` whose text hash is one of ``hashes`` (one Chroma query)."""
        if not hashes:
            return []
        got = self._col.get(where={"$and": [{"scope": scope.key}, {"hash": {"$in": list(hashes)}}]},
                            include=["documents", "metadatas"])
        return [FactRecord.from_chroma(i, d, m) for i, d, m in zip(got["ids"], got["documents"], got["metadatas"])]

    def list(self, scope: Scope) -> list[FactRecord]:
        """All records of ``scope``, oldest first."""
        got = self._get(["documents", "metadatas"], where={"scope": scope.key})
        records = [FactRecord.from_chroma(i, d, m) for i, d, m in zip(got["ids"], got["documents"], got["metadatas"])]
        return sorted(records, key=lambda r: (r.created_at, r.id))

    def load_scope(self, scope_key: str) -> tuple[list[FactRecord], np.ndarray]:
        """The records of one scope (by :attr:`Scope.key`) and their embeddings
        (``[n, dim]`` float32), for the index partition; one Chroma query on the scope field
        (past :data:`IDS_PER_READ` facts, their ids and then reads by id)."""
        got = self._get(["embeddings", "documents", "metadatas"], where={"scope": scope_key})
        if not got["ids"]:
            return [], np.zeros((0, 0), dtype=np.float32)
        records = [FactRecord.from_chroma(i, d, m) for i, d, m in zip(got["ids"], got["documents"], got["metadatas"])]
        return records, got["embeddings"]

    def fetch(self, scope_key: str, ids: list[str]) -> tuple[list[FactRecord], np.ndarray]:
        """The records of ``ids`` that are in the scope ``scope_key`` now, and their embeddings
        (``[n, dim]`` float32, in the records' order); absent ids (deleted, or of another
        scope) are left out. Reads by id (:data:`IDS_PER_READ` at a time), for an index
        partition's catch-up."""
        if not ids:
            return [], np.zeros((0, 0), dtype=np.float32)
        got = self._get(["embeddings", "documents", "metadatas"], ids=list(ids))
        keep = [j for j, m in enumerate(got["metadatas"]) if m.get("scope") == scope_key]
        if not keep:
            return [], np.zeros((0, 0), dtype=np.float32)
        records = [FactRecord.from_chroma(got["ids"][j], got["documents"][j], got["metadatas"][j]) for j in keep]
        return records, got["embeddings"][keep]

    def count(self) -> int:
        return self._col.count()

    def rows(self, ids: list[str] | None = None,
             include: tuple[str, ...] = ("embeddings", "documents", "metadatas")) -> dict:
        """Chroma's stored columns of every row (or of ``ids``; absent ids are left out):
        ``{"ids", and each of include}`` as lists, embeddings ``[n, dim]`` float32. For
        copying a store (:mod:`inferscale.store.embedded`)."""
        return self._get(list(include), ids=None if ids is None else list(ids))

    def write_rows(self, ids: list[str], embeddings: np.ndarray, documents: list[str], metadatas: list[dict]) -> None:
        """Write rows exactly as :meth:`rows` returned them (another store's), replacing rows of
        the same id, in batches of at most :attr:`max_batch` rows."""
        embeddings = np.asarray(embeddings, dtype=np.float32)
        with self._lock:
            for start in range(0, len(ids), self.max_batch):
                end = start + self.max_batch
                self._col.upsert(ids=list(ids[start:end]), embeddings=embeddings[start:end],
                                 documents=list(documents[start:end]), metadatas=list(metadatas[start:end]))
