"""SQLite files shared by threads and processes: one connection per thread, WAL journal,
autocommit, and explicit write transactions (the turn log, the history, the KV job queue)."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from pathlib import Path
from typing import Iterator


class ThreadConnections:
    """Per-thread connections to one SQLite file (a connection must stay in its thread).

    Args:
        path: the database file (created when missing).
        timeout: seconds a writer waits for another process's lock.
    """

    def __init__(self, path: Path, timeout: float = 60.0) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self._local = threading.local()

    def get(self) -> sqlite3.Connection:
        """This thread's connection (WAL journal, ``synchronous=NORMAL``, autocommit)."""
        con = getattr(self._local, "con", None)
        if con is None:
            con = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None)
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("PRAGMA synchronous=NORMAL")
            self._local.con = con
        return con

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT``: all of the block's writes or none."""
        con = self.get()
        con.execute("BEGIN IMMEDIATE")
        try:
            yield con
        except BaseException:
            con.execute("ROLLBACK")
            raise
        con.execute("COMMIT")
