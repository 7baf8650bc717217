"""The SQL database of the turn log and the history, through SQLAlchemy: SQLite files in the
data dir by default, or any database URL (PostgreSQL for many processes or machines).

SQLite: WAL journal, ``synchronous=NORMAL``, and write transactions that start with
``BEGIN IMMEDIATE`` so writers of several processes queue instead of failing (the
recipe of SQLAlchemy's pysqlite documentation, "Serializable isolation / Savepoints /
Transactional DDL"). PostgreSQL: a write that must be serialized per scope (the turn
log's ``seq``) takes a transaction-level advisory lock on the scope
(``pg_advisory_xact_lock``).
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Iterator

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import make_url

#: SQLAlchemy URL schemes InferScale is tested with.
TESTED_DIALECTS = ("sqlite", "postgresql")


class Database:
    """One SQLAlchemy engine, with write transactions that serialize as the turn log needs.

    Args:
        url: a SQLAlchemy database URL (``sqlite:///path``, ``postgresql+psycopg://user@host/db``).

    Raises:
        ValueError: the URL cannot be parsed, or names a dialect other than SQLite or PostgreSQL.
        ImportError: the URL's driver is not installed (``pip install 'inferscale[postgres]'``).
    """

    def __init__(self, url: str) -> None:
        parsed = check_url(url)
        self.dialect = parsed.get_backend_name()
        self.url = parsed
        self._lock_dir: Path | None = None
        if self.dialect == "sqlite":
            self.engine = create_engine(parsed, connect_args={"timeout": 60})
            _sqlite_immediate(self.engine)
        else:
            from inferscale.runtime.outages import OUTAGES

            self.engine = create_engine(parsed, pool_pre_ping=True, pool_size=8, max_overflow=16)
            OUTAGES.register_probe("postgresql", self._ping)

    def _ping(self) -> None:
        """``SELECT 1`` (raises while the server is down: the outage probe)."""
        with self.engine.connect() as connection:
            connection.exec_driver_sql("SELECT 1")

    @classmethod
    def sqlite_file(cls, path: Path) -> "Database":
        """The SQLite file ``path`` (created when missing)."""
        return cls(f"sqlite:///{Path(path)}")

    @contextlib.contextmanager
    def write(self, lock_key: str | None = None) -> Iterator[Connection]:
        """A write transaction: all of the block's writes or none. With ``lock_key``, writers
        of the same key (a scope) in any process wait for each other (SQLite: every writer)."""
        with self.engine.begin() as con:
            if lock_key is not None and self.dialect == "postgresql":
                con.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _lock_id(lock_key)})
            yield con

    @contextlib.contextmanager
    def scope_lock(self, key: str) -> Iterator[None]:
        """Hold an exclusive lock on ``key`` (a scope) against every thread and process that
        uses this database, for a write that spans several stores (Chroma, the index, the
        history): PostgreSQL's session-level advisory lock (``pg_advisory_lock``, released
        by the server when a holder's connection dies); for SQLite, ``flock(2)`` on one of
        256 lock files in ``<database>.locks/`` beside the database file (released by the
        kernel when a holder dies).
        Not re-entrant across two ``with`` blocks of one thread (use one block)."""
        if self.dialect == "postgresql":
            with self.engine.connect() as con:
                k = {"k": _lock_id(key)}
                con.execute(text("SELECT pg_advisory_lock(:k)"), k)
                con.commit()
                try:
                    yield
                finally:
                    con.execute(text("SELECT pg_advisory_unlock(:k)"), k)
                    con.commit()
            return
        import fcntl

        if self._lock_dir is None:  # created on the first lock, not on every write
            self._lock_dir = Path(self.url.database or ".").with_suffix(".locks")
            self._lock_dir.mkdir(parents=True, exist_ok=True)
        with open(self._lock_dir / f"{_lock_id(key) & 0xFF:02x}", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def create(self, metadata, *indexes) -> None:
        """Create ``metadata``'s tables and ``indexes`` where missing, in one write transaction
        under a lock, so processes starting together do not race (two PostgreSQL sessions
        creating one table both see it missing, and one fails)."""
        with self.write(lock_key="inferscale-schema") as con:
            metadata.create_all(con)
            for index in indexes:
                index.create(con, checkfirst=True)

    @contextlib.contextmanager
    def read(self) -> Iterator[Connection]:
        """A connection for reads (on SQLite a deferred ``BEGIN``, which never blocks a writer in WAL mode)."""
        with self.engine.connect().execution_options(inferscale_read=True) as con:
            yield con

    def dispose(self) -> None:
        """Close the pooled connections."""
        self.engine.dispose()

    def describe(self) -> str:
        """The URL without its password, for messages."""
        return self.url.render_as_string(hide_password=True)


def check_url(url: str):
    """``url`` parsed (a ``sqlalchemy.engine.URL``) if it is a SQLite or PostgreSQL URL.

    Raises:
        ValueError: it does not parse, or names another database (the message never echoes
            the URL, which may hold a password).
    """
    try:
        parsed = make_url(url)
    except Exception:  # noqa: BLE001 - sqlalchemy.exc.ArgumentError
        raise ValueError("database_url must be a SQLAlchemy URL such as "
                         "postgresql+psycopg://user:password@host:5432/db, got one that does not parse") from None
    if parsed.get_backend_name() not in TESTED_DIALECTS:
        raise ValueError(f"database_url must be a PostgreSQL (or SQLite) URL, got a {parsed.get_backend_name()!r} one")
    return parsed


def upsert_increment(con: Connection, table, key_column: str, key: str, counter: str) -> None:
    """``INSERT (key, 1)``, or add 1 to ``counter`` where the row exists (SQLite and PostgreSQL
    both spell it ``INSERT ... ON CONFLICT DO UPDATE``)."""
    if con.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    stmt = insert(table).values({key_column: key, counter: 1})
    con.execute(stmt.on_conflict_do_update(index_elements=[key_column],
                                           set_={counter: table.c[counter] + 1}))


def _lock_id(key: str) -> int:
    """A signed 64-bit advisory-lock id for ``key`` (the first 8 bytes of its SHA-256)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big", signed=True)


def _sqlite_immediate(engine: Engine) -> None:
    """pysqlite: WAL, autocommit off at the driver, and ``BEGIN IMMEDIATE`` at each transaction."""

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection, _record) -> None:
        dbapi_connection.isolation_level = None  # SQLAlchemy emits BEGIN itself
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn) -> None:
        conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get("inferscale_read") else "BEGIN IMMEDIATE")
