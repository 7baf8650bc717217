"""vLLM's OpenAI server(s) behind ``inferscale serve``, as seen from the front.

The front talks to one URL: a vLLM server, or vLLM's router in front of several replicas
(``inferscale serve --replicas N`` starts one, :mod:`inferscale.server.router_process`;
``--router-url`` names one you run). Routing is the router's: every request that names a
memory scope carries the scope's routing key in ``X-User-ID`` (:func:`routing_key`: a hash
of the scope's prefix-cache salt, so user ids stay out of the router's logs), which its
``consistent_hash`` policy maps to one replica while it lives; the router's health check
moves a dead replica's scopes and brings them back. The front does only what the router
cannot know: a request cut off before the first byte of its answer (the router restarting,
a connection reset) is sent once more; past that, the error is a 503 with ``Retry-After``
(:mod:`inferscale.server.errors`). :class:`Upstream` is the front's async client;
:class:`HttpEngine` gives :class:`inferscale.Memory` the engine method it needs in a
server, ``generate`` (KV encodes and fact extraction), through ``/v1/completions`` with
token-id prompts, routed the same way.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import httpx

from inferscale.kv.injection import cache_salt

logger = logging.getLogger(__name__)

#: Seconds to wait for vLLM: connecting, and between two bytes of a response (a long
#: prefill under load can take a while before the first byte).
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0
#: Seconds before a request cut off before its answer's first byte is sent once more.
RESEND_AFTER_S = 1.0
#: Failures before the first byte of an answer: connection refused or reset, or closed
#: before a response came. Chat and completion requests have no side effect in vLLM, so
#: such a request is sent once more.
UPSTREAM_DOWN_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
                        httpx.WriteError)
#: The header vLLM's router's ``consistent_hash`` policy hashes (it reads ``X-Session-ID``
#: first, then this one; the front sends only this one).
ROUTE_HEADER = "X-User-ID"


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The bearer-token header vLLM's server expects (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def routing_key(salt: str) -> str:
    """The routing key of the scope whose text-request prefix-cache salt is ``salt``
    (:func:`inferscale.kv.injection.cache_salt` of the scope key and no plan): 16 hex
    characters of BLAKE2b. A chat and the scope's KV encodes carry the same key, so they
    reach the same replica; the same in every process and on every machine."""
    return hashlib.blake2b(salt.encode(), digest_size=8).hexdigest()


def route_headers(scope_key: str | None) -> dict[str, str]:
    """The routing header of a request for ``scope_key`` (none for a request of no scope)."""
    return {ROUTE_HEADER: routing_key(cache_salt(scope_key, None))} if scope_key else {}


async def _probe(client: httpx.AsyncClient, url: str, timeout_s: float = 5.0) -> bool:
    try:
        return (await client.get(f"{url}/health", timeout=timeout_s)).status_code == 200
    except httpx.HTTPError:
        return False


class Upstream:
    """The front's client of vLLM: one URL (a vLLM server or vLLM's router).

    Args:
        url: where requests go (``http://host:port``, no ``/v1``).
        api_key: sent as a bearer token when given (vLLM's router passes it on).
        served_model_name: filled in as ``model`` when a request has none (default: the
            first of ``/v1/models``, asked when needed).
        replica_urls: the vLLM servers behind ``url`` when known (``/ready`` probes each
            and ``/metrics`` merges theirs); default: ``url`` alone.
        metrics_urls: more Prometheus endpoints whose samples ``/metrics`` shows (the router's).
    """

    def __init__(self, url: str, api_key: str | None = None, served_model_name: str | None = None,
                 replica_urls: Sequence[str] = (), metrics_urls: Sequence[str] = ()) -> None:
        self.url = url.rstrip("/")
        self.replica_urls = [u.rstrip("/") for u in replica_urls] or [self.url]
        self.metrics_urls = list(metrics_urls)
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(base_url=self.url, headers=auth_headers(api_key), timeout=timeout, limits=limits)
        self._model = served_model_name
        self.resent = 0

    async def send(self, scope_key: str | None, method: str, path: str, *, json: dict | None = None,
                   stream: bool = False) -> httpx.Response:
        """Send a request for ``scope_key``'s replica (``None``: any); one cut off before its
        answer's first byte is sent once more, ``RESEND_AFTER_S`` later.

        Returns:
            The response (open when ``stream``: the caller reads and closes it).

        Raises:
            httpx.HTTPError: no answer the second time either.
        """
        headers = route_headers(scope_key)
        for attempt in (1, 2):
            try:
                request = self.client.build_request(method, path, json=json, headers=headers)
                return await self.client.send(request, stream=stream)
            except UPSTREAM_DOWN_ERRORS:
                if attempt == 2:
                    raise
                self.resent += 1
                await asyncio.sleep(RESEND_AFTER_S)
        raise AssertionError("unreachable")

    async def model_name(self) -> str:
        """The served model's name (asked of ``/v1/models`` once)."""
        if self._model is None:
            r = await self.send(None, "GET", "/v1/models")
            r.raise_for_status()
            self._model = r.json()["data"][0]["id"]
        return self._model

    async def health(self) -> list[bool]:
        """Whether each replica answers ``/health`` with 200 (in :attr:`replica_urls` order),
        probed at the same time."""
        return list(await asyncio.gather(*(_probe(self.client, u) for u in self.replica_urls)))

    async def metrics(self) -> bytes:
        """The replicas' Prometheus metrics: one replica's as it gave them; several merged into
        one exposition with a ``replica`` label (its index) on every sample; then those of
        :attr:`metrics_urls` (vLLM's router's) as they come."""
        texts: list[tuple[int, str]] = []
        for index, url in enumerate(self.replica_urls):
            text = await self._get_text(f"{url}/metrics")
            if text is not None:
                texts.append((index, text))
        if len(self.replica_urls) == 1:
            out = texts[0][1].encode() if texts else b""
        else:
            out = merge_metrics(texts)
        for url in self.metrics_urls:
            text = await self._get_text(url)
            if text:
                out += text.encode() if text.endswith("\n") else (text + "\n").encode()
        return out

    async def _get_text(self, url: str) -> str | None:
        try:
            r = await self.client.get(url, timeout=10.0)
        except httpx.HTTPError:
            return None
        return r.text if r.status_code == 200 else None

    async def aclose(self) -> None:
        await self.client.aclose()


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


def relayed_failure(status: int, content: bytes) -> bool:
    """Whether an answer of HTTP ``status`` with body ``content`` is a 5xx that vLLM did not
    write (neither its JSON ``{"error": {...}}`` nor FastAPI's ``{"detail": ...}``): vLLM's
    router's or a proxy's text when a replica went down under the request. The one rule for
    both uses: :class:`HttpEngine` sends such a request once more, and the front answers it
    503 with ``Retry-After`` (:func:`inferscale.server.errors.upstream_error`)."""
    if status < 500:
        return False
    try:
        body = json.loads(content)
    except ValueError:
        return True
    return not (isinstance(body, dict) and (isinstance(body.get("error"), dict) or "detail" in body))


class HttpEngine:
    """The engine face :class:`inferscale.Memory` uses, over vLLM's ``/v1/completions``.

    Args:
        url: vLLM's server or router (``http://host:port``; ``None`` until :meth:`point_at`).
        kv_dir: the KV pool folder the servers' connector reads (must be the memory's
            ``<data_dir>/kv``). api_key: bearer token.
        served_model_name: the ``model`` of the requests.
    """

    def __init__(self, url: str | None, kv_dir: Path, served_model_name: str, api_key: str | None = None) -> None:
        self.kv_dir = Path(kv_dir)
        self.model = served_model_name
        self.url = url.rstrip("/") if url else None
        self._priority = True  # until a server refuses a priority (not started with priority scheduling)
        self._client = httpx.Client(headers=auth_headers(api_key),
                                    timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))

    def point_at(self, url: str, served_model_name: str) -> None:
        """Use this server (or router) and model name from now on (``inferscale serve`` opens
        the memory before its vLLM servers answer)."""
        self.url, self.model = url.rstrip("/"), served_model_name

    def generate(self, prompt_token_ids: Sequence[int], *, max_tokens: int, temperature: float = 0.0,
                 kv_transfer_params: dict | None = None, cache_salt: str | None = None, priority: int = 0,
                 **_: object) -> Completion:
        """Complete a token-id prompt; with a ``cache_salt`` (a scope's), routed to the scope's
        replica (:func:`routing_key`). One cut off before its answer's first byte is sent
        once more, ``RESEND_AFTER_S`` later.

        Args:
            kv_transfer_params: for the connector (a KV encode's capture, :mod:`inferscale.kv.engine_encoder`).
            cache_salt: the prefix-cache salt (the scope's).
            priority: vLLM's priority (lower first). A server started without
                ``--scheduling-policy priority`` refuses any but 0: the request is sent
                again without it, and later ones go without it (logged once).

        Raises:
            RuntimeError: vLLM answered with an error (its message included), or no URL is set.
            httpx.HTTPError: no answer the second time either.
        """
        if self.url is None:
            raise RuntimeError("the memory's vLLM server is not set yet (HttpEngine.point_at)")
        body = {"model": self.model, "prompt": list(prompt_token_ids), "max_tokens": max_tokens,
                "temperature": temperature}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        headers = {}
        if cache_salt:
            body["cache_salt"] = cache_salt
            headers[ROUTE_HEADER] = routing_key(cache_salt)
        if priority and self._priority:
            body["priority"] = priority
        r = self._post(body, headers)
        if r.status_code == 400 and "priority" in body and "riority scheduling" in r.text:
            logger.warning("vLLM at %s has no priority scheduling: KV encodes compete with requests; start "
                           "it with --scheduling-policy priority (docs/server.md)", self.url)
            self._priority = False
            del body["priority"]
            r = self._post(body, headers)
        if r.status_code != 200:
            raise RuntimeError(f"vLLM's /v1/completions answered {r.status_code}: {r.text[:500]}")
        return Completion(r.json()["choices"][0]["text"])

    def _post(self, body: dict, headers: dict[str, str]) -> httpx.Response:
        """POST ``body``; sent once more, ``RESEND_AFTER_S`` later, when cut off before an
        answer or answered with a 5xx that is not vLLM's own (its router's, a replica gone
        under the request)."""
        for attempt in (1, 2):
            try:
                r = self._client.post(f"{self.url}/v1/completions", json=body, headers=headers)
            except UPSTREAM_DOWN_ERRORS:
                if attempt == 2:
                    raise
            else:
                if attempt == 2 or not relayed_failure(r.status_code, r.content):
                    return r
            time.sleep(RESEND_AFTER_S)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._client.close()
