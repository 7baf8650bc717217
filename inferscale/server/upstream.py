"""The vLLM OpenAI server behind ``inferscale serve``, as seen from the front.

:class:`Upstream` holds one asynchronous HTTP client for the request path (chat,
completions, models, metrics) and :class:`HttpEngine` gives :class:`inferscale.Memory`
the one engine method it needs in a server, ``generate`` (fact extraction for
``add(infer=True)``), through ``/v1/completions`` with token-id prompts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import httpx

#: Seconds to wait for vLLM: connecting, and between two bytes of a response (a long
#: prefill under load can take a while before the first byte).
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class Upstream:
    """vLLM's OpenAI server at ``url`` (``http://host:port``, no ``/v1``).

    Args:
        url: where vLLM listens. api_key: sent as a bearer token when given.
        served_model_name: filled in as ``model`` when a request has none
            (default: the first of ``/v1/models``, asked when needed).
    """

    def __init__(self, url: str, api_key: str | None = None, served_model_name: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self._model = served_model_name
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(base_url=self.url, headers=_headers(api_key), timeout=timeout, limits=limits)

    async def model_name(self) -> str:
        """The served model's name (asked of ``/v1/models`` once)."""
        if self._model is None:
            r = await self.client.get("/v1/models")
            r.raise_for_status()
            self._model = r.json()["data"][0]["id"]
        return self._model

    async def ready(self) -> bool:
        """Whether vLLM answers ``/health`` with 200."""
        try:
            return (await self.client.get("/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def aclose(self) -> None:
        await self.client.aclose()


@dataclass(frozen=True)
class Completion:
    """What :meth:`HttpEngine.generate` returns: the answer ``text``."""

    text: str


class HttpEngine:
    """The engine face :class:`inferscale.Memory` uses, over vLLM's ``/v1/completions``.

    Args:
        url: vLLM's server (``http://host:port``). kv_dir: the KV pool folder that server's
            connector reads (must be the memory's ``<data_dir>/kv``). api_key: bearer token.
        served_model_name: the ``model`` of the requests.
    """

    def __init__(self, url: str, kv_dir: Path, served_model_name: str, api_key: str | None = None) -> None:
        self.kv_dir = Path(kv_dir)
        self.model = served_model_name
        self._client = httpx.Client(base_url=url.rstrip("/"), headers=_headers(api_key),
                                    timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))

    def generate(self, prompt_token_ids: Sequence[int], *, max_tokens: int, temperature: float = 0.0,
                 **_: object) -> Completion:
        """Complete a token-id prompt.

        Raises:
            RuntimeError: vLLM answered with an error (its message included).
        """
        r = self._client.post("/v1/completions", json={
            "model": self.model, "prompt": list(prompt_token_ids), "max_tokens": max_tokens,
            "temperature": temperature})
        if r.status_code != 200:
            raise RuntimeError(f"vLLM's /v1/completions answered {r.status_code}: {r.text[:500]}")
        return Completion(r.json()["choices"][0]["text"])

    def close(self) -> None:
        self._client.close()
