"""The vLLM OpenAI servers behind ``inferscale serve``, as seen from the front.

One front may sit in front of several vLLM replicas (``inferscale serve --replicas N``,
or ``--vllm-url`` given more than once). :class:`Replicas` routes each request by a
stable hash of its memory scope (rendezvous hashing over the replicas' indexes), so a
user's requests all reach one replica and find its KV in that replica's device tier and
prefix cache; when that replica does not answer, the request goes to the scope's next
replica in the same order (failover), and the dead one is tried again after
``retry_after_s``; a replica that hangs is found by probing its ``/health``
(:meth:`Replicas.watch`, run by the front when it has several replicas). Every front process computes the same order, so routing needs no
shared state. :class:`HttpEngine` gives :class:`inferscale.Memory` the one engine method
it needs in a server, ``generate`` (fact extraction for ``add(infer=True)``), through
``/v1/completions`` with token-id prompts, taking the replicas in turn and skipping one
that does not answer.

Rendezvous hashing: D. G. Thaler and C. V. Ravishankar, "Using name-based mappings to
increase hit rates", IEEE/ACM Transactions on Networking 6(1), 1998: a replica leaving
moves only the scopes it served.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import httpx

logger = logging.getLogger(__name__)

#: Seconds to wait for vLLM: connecting, and between two bytes of a response (a long
#: prefill under load can take a while before the first byte).
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0
#: Seconds a replica that did not answer is passed over before it is tried again.
RETRY_AFTER_S = 5.0
#: The health watch (:meth:`Replicas.watch`): seconds between two probes of a replica's
#: ``/health``, the seconds a probe may take, and the failed probes in a row after which
#: a replica that accepts connections but does not answer (hung, not dead) is passed over.
PROBE_INTERVAL_S = 2.0
PROBE_TIMEOUT_S = 5.0
PROBE_FAILURES = 2
#: Failures that mean the replica is down or went down under the request: connection
#: refused or reset, or the connection closed before a response came. A chat request has
#: no side effect in vLLM, so it is sent again to the next replica.
REPLICA_DOWN_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
                       httpx.WriteError)


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The bearer-token header vLLM's server expects (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def rendezvous_order(key: str, n: int) -> list[int]:
    """Replica indexes ``0..n-1`` in ``key``'s preference order (highest random weight first).

    The weight of replica ``i`` is the first 8 bytes of ``blake2b(f"{i}:{key}")``: the same
    in every process and on every machine (Python's ``hash`` is salted per process).
    """
    def weight(i: int) -> int:
        return int.from_bytes(hashlib.blake2b(f"{i}:{key}".encode(), digest_size=8).digest(), "big")

    return sorted(range(n), key=weight, reverse=True)


class Replica:
    """One vLLM OpenAI server: its index, URL (``http://host:port``, no ``/v1``) and client."""

    def __init__(self, index: int, url: str, api_key: str | None) -> None:
        self.index = index
        self.url = url.rstrip("/")
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(base_url=self.url, headers=auth_headers(api_key), timeout=timeout, limits=limits)
        self.down_until = 0.0
        self.failovers = 0
        self.failed_probes = 0  # in a row, by the health watch

    def up(self) -> bool:
        """Whether the replica is tried first (it answered last time, or its pause is over)."""
        return time.monotonic() >= self.down_until


class Replicas:
    """vLLM's OpenAI servers behind the front, routed by scope.

    Args:
        urls: the servers (``http://host:port``), at least one; a server's index in this
            list is its name in the routing hash, so give every front the same list.
        api_key: sent as a bearer token when given.
        served_model_name: filled in as ``model`` when a request has none (default: the
            first of ``/v1/models``, asked when needed).
        retry_after_s: seconds a replica that did not answer is passed over.

    Raises:
        ValueError: ``urls`` is empty.
    """

    def __init__(self, urls: Sequence[str], api_key: str | None = None, served_model_name: str | None = None,
                 retry_after_s: float = RETRY_AFTER_S) -> None:
        if not urls:
            raise ValueError("the front needs at least one vLLM server URL")
        self.replicas = [Replica(i, u, api_key) for i, u in enumerate(urls)]
        self.retry_after_s = retry_after_s
        self._model = served_model_name

    def __len__(self) -> int:
        return len(self.replicas)

    def order(self, key: str) -> list[Replica]:
        """The replicas to try for routing key ``key`` (a scope key): its rendezvous order,
        with replicas that recently failed moved to the end (still tried, last)."""
        ranked = [self.replicas[i] for i in rendezvous_order(key, len(self.replicas))]
        return [r for r in ranked if r.up()] + [r for r in ranked if not r.up()]

    async def send(self, key: str, method: str, path: str, *, json: dict | None = None,
                   stream: bool = False) -> tuple[Replica, httpx.Response]:
        """Send a request to ``key``'s replica, failing over to the next one that answers.

        Returns:
            The replica that answered and its response (open when ``stream``: the caller
            reads and closes it).

        Raises:
            httpx.HTTPError: no replica answered (the last one's error).
        """
        error: httpx.HTTPError | None = None
        for replica in self.order(key):
            try:
                request = replica.client.build_request(method, path, json=json)
                response = await replica.client.send(request, stream=stream)
            except REPLICA_DOWN_ERRORS as exc:
                replica.down_until = time.monotonic() + self.retry_after_s
                replica.failovers += 1
                error = exc
                continue
            replica.down_until = 0.0
            return replica, response
        assert error is not None
        raise error

    async def probe(self, timeout_s: float = PROBE_TIMEOUT_S, failures: int = PROBE_FAILURES) -> list[bool]:
        """Probe every replica's ``/health`` once, at the same time; a replica whose last
        ``failures`` probes failed (no answer within ``timeout_s`` seconds, or not 200) is
        passed over for ``retry_after_s``, like one that refused a connection. A replica
        that answers is counted healthy again (its pause is lifted).

        Returns:
            Whether each replica answered (in index order).
        """
        async def one(replica: Replica) -> bool:
            try:
                ok = (await replica.client.get("/health", timeout=timeout_s)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                replica.failed_probes, replica.down_until = 0, 0.0
            else:
                replica.failed_probes += 1
                if replica.failed_probes >= failures:
                    replica.down_until = time.monotonic() + max(self.retry_after_s, PROBE_INTERVAL_S + timeout_s)
            return ok

        return list(await asyncio.gather(*(one(r) for r in self.replicas)))

    async def watch(self, interval_s: float = PROBE_INTERVAL_S, timeout_s: float = PROBE_TIMEOUT_S) -> None:
        """Probe the replicas every ``interval_s`` seconds until cancelled (:meth:`probe`):
        a replica that hangs (its port open, its server not answering) stops getting new
        requests within about ``PROBE_FAILURES * (interval_s + timeout_s)`` seconds,
        instead of each request waiting out ``READ_TIMEOUT_S``. Requests already sent to it
        are not moved (a streamed answer cannot be resent)."""
        while True:
            await self.probe(timeout_s)
            await asyncio.sleep(interval_s)

    async def model_name(self) -> str:
        """The served model's name (asked of ``/v1/models`` once)."""
        if self._model is None:
            _, r = await self.send("", "GET", "/v1/models")
            r.raise_for_status()
            self._model = r.json()["data"][0]["id"]
        return self._model

    async def health(self) -> list[bool]:
        """Whether each replica answers ``/health`` with 200 (in index order)."""
        out = []
        for replica in self.replicas:
            try:
                out.append((await replica.client.get("/health", timeout=5.0)).status_code == 200)
            except httpx.HTTPError:
                out.append(False)
        return out

    async def metrics(self) -> bytes:
        """The replicas' Prometheus metrics: one replica's as it gave them; several merged into
        one exposition with a ``replica`` label (its index) on every sample."""
        texts: list[tuple[int, str]] = []
        for replica in self.replicas:
            try:
                r = await replica.client.get("/metrics", timeout=10.0)
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                texts.append((replica.index, r.text))
        if len(self.replicas) == 1:
            return texts[0][1].encode() if texts else b""
        return merge_metrics(texts)

    async def aclose(self) -> None:
        for replica in self.replicas:
            await replica.client.aclose()


def merge_metrics(texts: Sequence[tuple[int, str]]) -> bytes:
    """Merge Prometheus text expositions of several replicas, labelling each sample
    ``replica="<index>"`` (prometheus_client's parser and writer)."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, object] = {}
    for index, text in texts:
        for family in text_string_to_metric_families(text):
            samples = [s._replace(labels={**s.labels, "replica": str(index)}) for s in family.samples]
            if family.name in families:
                families[family.name].samples.extend(samples)
            else:
                family.samples = samples
                families[family.name] = family

    class _Merged:
        def collect(self):
            return list(families.values())

    return generate_latest(_Merged())


@dataclass(frozen=True)
class Completion:
    """What :meth:`HttpEngine.generate` returns: the answer ``text``."""

    text: str


class HttpEngine:
    """The engine face :class:`inferscale.Memory` uses, over vLLM's ``/v1/completions``.

    Args:
        urls: vLLM's servers (``http://host:port``; one, or the replicas, tried in turn
            when one does not answer). kv_dir: the KV pool folder their connector reads
            (must be the memory's ``<data_dir>/kv``). api_key: bearer token.
        served_model_name: the ``model`` of the requests.
    """

    def __init__(self, urls: str | Sequence[str], kv_dir: Path, served_model_name: str,
                 api_key: str | None = None) -> None:
        self.kv_dir = Path(kv_dir)
        self.model = served_model_name
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        self._next = 0
        self._priority = True  # until a server refuses a priority (not started with priority scheduling)
        self._client = httpx.Client(headers=auth_headers(api_key),
                                    timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))

    def point_at(self, urls: Sequence[str], served_model_name: str) -> None:
        """Use these servers and model name from now on (``inferscale serve`` opens the memory
        before its vLLM servers answer)."""
        self.urls, self.model = list(urls), served_model_name

    def generate(self, prompt_token_ids: Sequence[int], *, max_tokens: int, temperature: float = 0.0,
                 kv_transfer_params: dict | None = None, cache_salt: str | None = None, priority: int = 0,
                 **_: object) -> Completion:
        """Complete a token-id prompt (on the replicas in turn, skipping one that does not answer).

        Args:
            kv_transfer_params: for the connector (a KV encode's capture, :mod:`inferscale.kv.engine_encoder`).
            cache_salt: the prefix-cache salt (the scope's).
            priority: vLLM's priority (lower first). A server started without
                ``--scheduling-policy priority`` refuses any but 0: the request is sent
                again without it, and later ones go without it (logged once).

        Raises:
            RuntimeError: vLLM answered with an error (its message included).
            httpx.HTTPError: no replica answered.
        """
        body = {"model": self.model, "prompt": list(prompt_token_ids), "max_tokens": max_tokens,
                "temperature": temperature}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        if cache_salt:
            body["cache_salt"] = cache_salt
        if priority and self._priority:
            body["priority"] = priority
        start, self._next = self._next, (self._next + 1) % len(self.urls)
        error: httpx.HTTPError | None = None
        for i in range(len(self.urls)):
            url = self.urls[(start + i) % len(self.urls)].rstrip("/")
            try:
                r = self._client.post(f"{url}/v1/completions", json=body)
                if r.status_code == 400 and "priority" in body and "riority scheduling" in r.text:
                    logger.warning("vLLM at %s has no priority scheduling: KV encodes compete with requests; start "
                                   "it with --scheduling-policy priority (docs/server.md)", url)
                    self._priority = False
                    del body["priority"]
                    r = self._client.post(f"{url}/v1/completions", json=body)
            except REPLICA_DOWN_ERRORS as exc:
                error = exc
                continue
            if r.status_code != 200:
                raise RuntimeError(f"vLLM's /v1/completions answered {r.status_code}: {r.text[:500]}")
            return Completion(r.json()["choices"][0]["text"])
        assert error is not None
        raise error

    def close(self) -> None:
        self._client.close()
