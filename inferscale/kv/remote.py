"""The KV pool's shared tier on Redis (or Valkey): one value per entry, across machines.

Every process of every deployment that names the same ``kv_redis_url`` shares it: the
encoder writes each entry through to it (after the local disk), and a process whose own
tiers miss an entry reads it from here (the front when it plans or quantizes, the connector
in vLLM's process when it injects), so a fact encoded on one machine is injected on another
with no encode there. KV is content-addressed (:func:`inferscale.kv.pool.kv_key`), so two
writers of a key write the same bytes.

**Values.** Key ``inferscale:kv:{<owner>}/<variant>``; the braces are Redis Cluster's hash
tag, so a fact's variants share a slot and one ``DEL`` drops them. The value is the same
safetensors bytes as a disk-tier file (:func:`inferscale.kv.entry.to_tensors`).

**Eviction is Redis's.** The tier sets no TTL and counts no budget: run Redis with
``maxmemory <bytes>`` and ``maxmemory-policy allkeys-lfu`` (approximate LFU with decay,
Redis's documented policy for caches: https://redis.io/docs/latest/develop/reference/eviction/),
and it drops the least frequently used entries when full. An entry Redis evicted is a miss
like any other: the memory is served as text and its KV encoded again.

**Standalone or cluster.** The URL names any node; a node that answers ``cluster_enabled:1``
to ``INFO cluster`` is used through redis-py's ``RedisCluster``.

**An outage is never an error.** Every call has a timeout (:attr:`RedisTier.TIMEOUT_S`).
The first failure marks the tier down: calls return "absent" (reads, lookups) or are
skipped (writes; the entry stays on the local disk) without touching the network, until
:attr:`RedisTier.RETRY_S` seconds pass and the next call tries again. The log gets one
warning when an outage starts and one line when Redis answers again. A delete Redis did not
take (a memory deleted or updated during the outage) is kept and done when it answers again,
so a deleted memory's KV (whose token ids are its text) does not stay readable there.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import urlsplit

from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from inferscale.kv.entry import StoredKV, from_tensors, to_tensors

log = logging.getLogger(__name__)

PREFIX = "inferscale:kv:"


def redis_key(key: str) -> str:
    """The Redis key of pool key ``"<owner>/<variant>"``: ``inferscale:kv:{<owner>}/<variant>``."""
    owner, variant = key.split("/")
    return f"{PREFIX}{{{owner}}}/{variant}"


def redacted(url: str) -> str:
    """``url`` without its password, in the user info or a ``password=`` option (for logs and errors)."""
    head, sep, query = url.partition("?")
    if sep and "password" in query.lower():
        query = "&".join("password=***" if part.split("=", 1)[0].lower() == "password" else part
                         for part in query.split("&"))
    parts = urlsplit(head)
    if "@" in parts.netloc:
        userinfo, host = parts.netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0] if ":" in userinfo else ""  # a lone userinfo is a password to Redis
        start = head.index(parts.netloc)
        head = f"{head[:start]}{user}:***@{host}{head[start + len(parts.netloc):]}"
    return head + sep + query


def check_url(url: str) -> None:
    """Refuse a Redis URL that could never work, before anything uses it.

    Accepts ``redis://[[user]:password@]host[:port][/db][?option=value...]``, ``rediss://``
    (TLS) and ``unix:///path.sock``, with the options redis-py reads (``socket_timeout``,
    ``ssl_cert_reqs``, ...).

    Raises:
        ValueError: what is wrong, naming the URL without its password.
    """
    shown = redacted(url)
    if url != url.strip():
        raise ValueError(f"a Redis URL has no spaces around it, got {shown!r}")
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix") or (parts.scheme != "unix" and not parts.hostname) \
            or (parts.scheme == "unix" and not parts.path):
        raise ValueError(f"a Redis URL looks like redis://host:6379/0 (rediss:// for TLS, unix:///path.sock), "
                         f"got {shown!r}")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"a Redis URL's port is a number from 1 to 65535, got {shown!r}")
    db = parts.path.strip("/") if parts.scheme != "unix" else "0"
    if db and not db.isdigit():
        raise ValueError(f"a Redis URL's path is a database number (redis://host:6379/0), got {shown!r}")
    try:
        import redis
    except ImportError:  # RedisTier says how to install it
        return
    try:
        redis.ConnectionPool.from_url(url).make_connection()  # builds a connection object; connects nowhere
    except (TypeError, ValueError) as exc:
        raise ValueError(f"redis-py cannot use this Redis URL ({str(exc).rstrip('.')}; see redis-py's "
                         f"Redis.from_url for the options it takes), got {shown!r}") from None


def encode(kv: StoredKV) -> bytes:
    """``kv`` as the bytes of a safetensors file (:func:`inferscale.kv.entry.to_tensors`)."""
    tensors, meta = to_tensors(kv)
    return save_tensors(tensors, metadata=meta)


def decode(data: bytes) -> StoredKV:
    """Inverse of :func:`encode`.

    Raises:
        ValueError: not safetensors bytes of a pool entry (truncated, another format).
    """
    try:
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
        return from_tensors(load_tensors(data), meta)
    except Exception as exc:  # anything unreadable is a miss, never a crash of the reader
        raise ValueError(f"not a stored KV entry ({len(data)} bytes): {exc}") from exc


class RedisTier:
    """Pool entries in Redis at ``url``; see the module docstring.

    Args:
        url: ``redis://[[user]:password@]host:port[/db]`` (``rediss://`` for TLS), any
            node of a cluster.

    Raises:
        ImportError: redis-py is not installed (``pip install 'inferscale[redis]'``).
        ValueError: ``url`` is not a Redis URL redis-py can use (:func:`check_url`).

    Thread-safe. The connection is made on first use, so a Redis that is down at start is
    an outage like any other.
    """

    #: seconds a call waits for Redis (connect, then each command) before the tier is marked down
    TIMEOUT_S = 1.0
    #: seconds a down tier stays skipped before the next call tries Redis again
    RETRY_S = 5.0
    #: deletes kept while Redis is down, run when it answers again (more are dropped: logged)
    PENDING_DELETES = 100_000

    def __init__(self, url: str, pending_path: Path | None = None) -> None:
        try:
            import redis  # noqa: F401
        except ImportError as exc:  # pragma: no cover - the dev extras install it
            raise ImportError("kv_redis_url needs redis-py: pip install 'inferscale[redis]'") from exc
        try:
            check_url(url)
        except ValueError as exc:
            raise ValueError(f"kv_redis_url: {exc}") from None
        self.url = url
        self._client: Any = None
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._answered_errors: set[str] = set()
        # deletes Redis has not taken yet ("del <key>" / "match <pattern>"), kept in
        # pending_path too, so a close or a crash during an outage loses none
        self._pending_path = None if pending_path is None else Path(pending_path)
        self._pending: dict[str, None] = dict.fromkeys(self._read_pending())
        self.stats = {"hits": 0, "misses": 0, "writes": 0, "errors": 0}
        if self._pending:  # left by an earlier process: done now if Redis answers (1 s at most if not)
            self._call("deleting", lambda c: True, None)

    # ------------------------------------------------------------------ connection and outages

    def _connect(self) -> Any:
        import redis
        from redis.cluster import RedisCluster

        opts = dict(socket_timeout=self.TIMEOUT_S, socket_connect_timeout=self.TIMEOUT_S)
        client = redis.Redis.from_url(self.url, **opts)
        if client.info("cluster").get("cluster_enabled"):
            client.close()
            client = RedisCluster.from_url(self.url, **opts)
        return client

    def _call(self, what: str, fn, default):
        """``fn(client)``, or ``default`` when the tier is down or the call fails.

        A failure to connect or a lost connection (and anything unexpected) marks the tier
        down; an error Redis answers for this one command (``ResponseError``: out of memory
        under ``noeviction``, a key of another type) fails only the call, logged once per
        kind of error, and the tier stays up for the calls that work."""
        import redis

        now = time.monotonic()
        with self._lock:
            if self._down_since is not None and now < self._retry_at:
                return default
            client = self._client
        connected = client is not None
        try:
            if client is None:
                client = self._connect()
                with self._lock:
                    self._client = client
            connected = True
            if self._pending:  # deletes kept from an outage first: no read of a deleted entry before them
                self._flush_pending(client)
            result = fn(client)
        except redis.ResponseError as exc:
            if not connected:  # refused at connect (a database index out of range): as an outage
                return self._failed(what, exc, default)
            with self._lock:
                self.stats["errors"] += 1
                kind = str(exc)[:60]
                first = kind not in self._answered_errors and len(self._answered_errors) < 100
                if first:
                    self._answered_errors.add(kind)
            if first:
                log.warning("Redis KV tier at %s answered an error while %s (%s); that call is skipped (the entry "
                            "stays in the local tiers); further errors like it are not logged",
                            redacted(self.url), what, exc)
            return default
        except Exception as exc:  # noqa: BLE001 - whatever it is, Redis must not fail a request
            return self._failed(what, exc, default)
        with self._lock:
            down_since, self._down_since = self._down_since, None
        if down_since is not None:
            log.warning("Redis KV tier at %s answers again after %.0f s", redacted(self.url),
                        time.monotonic() - down_since)
        return result

    def _failed(self, what: str, exc: Exception, default):
        """Mark the tier down after ``exc`` (one warning when an outage starts); ``default``."""
        import redis

        with self._lock:
            self.stats["errors"] += 1
            self._retry_at = time.monotonic() + self.RETRY_S
            started = self._down_since is None
            if started:
                self._down_since = time.monotonic()
        if started:
            how = "is unreachable" if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OSError)) \
                else "is failing"
            log.warning("Redis KV tier at %s %s (%s while %s: %s); serving from the local tiers and as text until "
                        "it answers again", redacted(self.url), how, type(exc).__name__, what,
                        redacted(str(exc)) if "://" in str(exc) else exc)
        return default

    @property
    def available(self) -> bool:
        """Whether the last call reached Redis (``True`` before the first)."""
        with self._lock:
            return self._down_since is None

    # ------------------------------------------------------------------ entries

    def get(self, key: str) -> StoredKV | None:
        """The entry for pool key ``key`` on the CPU, or ``None`` (absent, unreadable, or Redis down)."""
        data = self._call("reading", lambda c: c.get(redis_key(key)), None)
        if data is None:
            with self._lock:
                self.stats["misses"] += 1
            return None
        try:
            kv = decode(data)
        except ValueError as exc:
            log.warning("Redis KV entry %s is unreadable and is deleted (encoded again when needed): %s", key, exc)
            self._call("deleting an unreadable entry", lambda c: c.delete(redis_key(key)), 0)
            with self._lock:
                self.stats["misses"] += 1
            return None
        with self._lock:
            self.stats["hits"] += 1
        return kv

    def put(self, key: str, kv: StoredKV) -> bool:
        """Write ``kv`` under ``key`` (no TTL: Redis's ``maxmemory-policy`` evicts); ``False``
        when Redis is down (the entry is then only in the local tiers)."""
        data = encode(kv)
        done = self._call("writing", lambda c: c.set(redis_key(key), data), False)
        if done:
            with self._lock:
                self.stats["writes"] += 1
        return bool(done)

    def present(self, keys: Iterable[str]) -> set[str]:
        """Which of ``keys`` Redis holds, in one round trip (none when Redis is down)."""
        keys = list(keys)
        if not keys:
            return set()

        def lookup(client) -> set[str]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(redis_key(key))
            return {key for key, n in zip(keys, pipe.execute()) if n}
        return self._call("looking up", lookup, set())

    def remove(self, key: str) -> None:
        """Delete one entry (absent is fine; while Redis is down, done when it answers again)."""
        self._delete(f"del {redis_key(key)}")

    def remove_owner(self, owner: str) -> None:
        """Delete every entry of ``owner`` (a fact id): its keys share a hash slot."""
        self._delete(f"match {PREFIX}{{{owner}}}/*")

    def clear(self) -> None:
        """Delete every InferScale KV entry in this Redis (other keys are left alone)."""
        self._delete(f"match {PREFIX}*")

    @staticmethod
    def _run_delete(client, what: str) -> bool:
        kind, _, name = what.partition(" ")
        if kind == "del":
            client.delete(name)
        else:
            _delete_matching(client, name)
        return True

    def _delete(self, what: str) -> None:
        """Run delete ``what``; when Redis does not answer, keep it (at most
        :attr:`PENDING_DELETES`, in memory and in the pending file) and run it when Redis
        answers again, in this process or the next one over the folder: a memory deleted
        during an outage (its token ids are its text) must not stay readable from Redis."""
        if self._call("deleting", lambda c: self._run_delete(c, what), False):
            return
        with self._lock:
            if len(self._pending) >= self.PENDING_DELETES or what in self._pending:
                return
            self._pending[what] = None
            self._append_pending(what)

    def _read_pending(self) -> list[str]:
        if self._pending_path is None:
            return []
        try:
            lines = self._pending_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return []
        return [line for line in lines if line.startswith(("del " + PREFIX, "match " + PREFIX))]

    def _append_pending(self, what: str) -> None:
        if self._pending_path is None:
            return
        try:
            with open(self._pending_path, "a", encoding="utf-8") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                f.write(what + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:  # a full disk: the delete stays kept in memory
            log.warning("cannot keep a Redis delete in %s (%s): it is kept in memory only", self._pending_path, exc)

    def _flush_pending(self, client) -> None:
        """Run the deletes kept during an outage, this process's and the pending file's
        (called once Redis answers); the file keeps what is still not done."""
        lock = None
        if self._pending_path is not None:
            try:
                lock = open(self._pending_path, "a+", encoding="utf-8")
                fcntl.flock(lock, fcntl.LOCK_EX)  # other processes over the folder append meanwhile
            except OSError:
                lock = None
        try:
            with self._lock:
                pending = list(dict.fromkeys([*self._pending, *self._read_pending()]))
                self._pending = {}
            done = 0
            for what in pending:
                try:
                    self._run_delete(client, what)
                except Exception:  # noqa: BLE001 - down again: keep the rest for the next time
                    break
                done += 1
            left = pending[done:]
            with self._lock:
                self._pending.update(dict.fromkeys(left))
            if lock is not None:
                lock.seek(0)
                lock.truncate()
                lock.write("".join(w + "\n" for w in left))
                lock.flush()
                os.fsync(lock.fileno())
        finally:
            if lock is not None:
                lock.close()
        if done:
            log.warning("Redis KV tier at %s: %d deletes kept during the outage are done", redacted(self.url), done)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a dead connection is fine
                pass


def _delete_matching(client: Any, pattern: str) -> None:
    """``DEL`` every key matching ``pattern``, a thousand a pipeline."""
    batch = []
    for name in client.scan_iter(match=pattern, count=1000):
        batch.append(name)
        if len(batch) >= 1000:
            _delete_each(client, batch)
            batch = []
    if batch:
        _delete_each(client, batch)


def _delete_each(client: Any, names: list) -> None:
    """``DEL`` each name (one pipeline): keys of different owners may be in different slots."""
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.delete(name)
    pipe.execute()
