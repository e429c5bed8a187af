"""Client of Search-R1's retrieval server: ``POST /retrieve``.

Request ``{"queries": [...], "topk": k, "return_scores": true}``; response
``{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}`` (or, without scores,
each entry is the document itself). One call carries a whole batch of queries. Every attempt has
a timeout; a failed attempt (connection error, timeout, non-200, malformed body) is retried after
``backoff_s * 2**attempt`` seconds, ``max_retries`` times; then ``RetrieverError`` names the URL
and the last failure.

    r = HttpRetriever("http://127.0.0.1:8000/retrieve", timeout_s=30, max_retries=3)
    docs = await r.retrieve(["capital of Zorvania"], topk=3)
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp

from asyncrl.agent.tools.base import RetrieverError

log = logging.getLogger(__name__)


class HttpRetriever:
    def __init__(self, url: str, *, timeout_s: float = 30.0, max_retries: int = 3, backoff_s: float = 0.5):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"agentloop.tool.retriever_url: expected http(s)://host:port/retrieve, got {url!r}")
        self.url = url
        self.name = url
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.num_retries = 0
        """Retried attempts so far (all calls)."""
        self.num_failures = 0
        """Calls that failed for good."""
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def retrieve(self, queries: list[str], topk: int) -> list[list[dict]]:
        if not queries:
            return []
        payload = {"queries": list(queries), "topk": int(topk), "return_scores": True}
        last_error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.num_retries += 1
                delay = self.backoff_s * 2 ** (attempt - 1)
                log.warning("retriever %s: attempt %d failed (%s); retrying in %.2fs", self.url, attempt,
                            last_error, delay)
                await asyncio.sleep(delay)
            try:
                return await self._post(payload, len(queries))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self.num_failures += 1
        raise RetrieverError(f"retriever {self.url} failed after {self.max_retries + 1} attempts: {last_error}")

    async def _post(self, payload: dict, num_queries: int) -> list[list[dict]]:
        async with self._get_session().post(self.url, json=payload) as resp:
            body = await resp.text()
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}: {body[:200]}")
        try:
            result = json.loads(body)["result"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"malformed response (no 'result'): {body[:200]}") from None
        if not isinstance(result, list) or len(result) != num_queries:
            raise ValueError(f"expected {num_queries} result lists, got {type(result).__name__}")
        return [[_as_doc(entry) for entry in row] for row in result]

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()


def _as_doc(entry: dict) -> dict:
    """A result entry with or without scores -> the document dict (with ``contents``)."""
    if not isinstance(entry, dict):
        raise ValueError(f"result entry is a {type(entry).__name__}, not an object")
    doc = entry["document"] if "document" in entry else entry
    if not isinstance(doc, dict) or "contents" not in doc:
        raise ValueError("result entry has no document 'contents'")
    return doc
