"""Client of Search-R1's retrieval server: ``POST /retrieve``.

Request ``{"queries": [...], "topk": k, "return_scores": true}``; response
``{"result": [[{"document": {"id", "contents"}, "score": s}, ...], ...]}`` (or, without scores,
each entry is the document itself). One call carries a whole batch of queries. Every attempt has
a timeout; a failed attempt (connection error, timeout, non-200, malformed body: a row that is not a list,
an entry without a string ``contents``, a body over ``MAX_RESPONSE_BYTES``) is retried after
``backoff_s * 2**attempt`` seconds (at most ``MAX_BACKOFF_S``), ``max_retries`` times; then, with
``max_outage_s = 0``, ``RetrieverError`` names the URL and the last failure. With ``max_outage_s > 0``
(``agentloop.tool.max_outage_s``, the workers) an outage is declared instead: ``wait_available()`` blocks
(the agent loop starts no new turn: nothing is trained from a sample biased to groups that never
search) and the call keeps retrying until the retriever answers (the outage ends) or the outage lasted
``max_outage_s``: ``RetrieverOutageError`` names the URL and fails the worker. ``num_errors`` counts
failed attempts (``tool/errors``).

    r = HttpRetriever("http://127.0.0.1:8000/retrieve", timeout_s=30, max_retries=3)
    docs = await r.retrieve(["capital of Zorvania"], topk=3)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp

from asyncrl.agent.tools.base import RetrieverError, RetrieverOutageError

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 5.0
"""The longest pause between two attempts during an outage."""

MAX_RESPONSE_BYTES = 64 << 20
"""The largest response body read. The agent loop sends one query per call (topk documents of ~100 words:
a few KB); a batching client a few hundred queries x topk <= 10 (a few MB). A body over this is not an answer
(a misrouted URL, a server streaming garbage) and must not fill the worker's memory."""


class HttpRetriever:
    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_outage_s: float = 0.0,
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"agentloop.tool.retriever_url: expected http(s)://host:port/retrieve, got {url!r}")
        self.url = url
        self.name = url
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_outage_s = max_outage_s
        self.num_retries = 0
        """Retried attempts so far (all calls)."""
        self.num_errors = 0
        """Failed attempts so far (all calls): ``tool/errors``."""
        self.num_failures = 0
        """Calls that failed for good."""
        self.down_since: float | None = None
        """``time.monotonic()`` when the current outage was declared; None while the retriever answers."""
        self._available = asyncio.Event()
        self._available.set()
        self._session: aiohttp.ClientSession | None = None

    @property
    def down(self) -> bool:
        return self.down_since is not None

    async def wait_available(self) -> None:
        """Returns at once unless an outage is declared; then when the retriever answers again."""
        if not self._available.is_set():
            await self._available.wait()

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def retrieve(self, queries: list[str], topk: int, *, stats: dict | None = None) -> list[list[dict]]:
        """The documents of each query. ``stats["tool_errors"]`` counts this call's failed attempts."""
        if not queries:
            return []
        payload = {"queries": list(queries), "topk": int(topk), "return_scores": True}
        attempt = 0
        while True:
            try:
                result = await self._post(payload, len(queries))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                err = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                self._outage_ends()
                return result
            attempt += 1
            self.num_errors += 1
            if stats is not None:
                stats["tool_errors"] = stats.get("tool_errors", 0) + 1
            self._check_outage(attempt, err)
            self.num_retries += 1
            delay = min(self.backoff_s * 2 ** min(attempt - 1, 30), MAX_BACKOFF_S)
            log.warning("retriever %s: attempt %d failed (%s); retrying in %.2fs", self.url, attempt, err, delay)
            await asyncio.sleep(delay)

    def _check_outage(self, attempt: int, err: str) -> None:
        """After ``max_retries`` retries: without an outage budget the call fails (``RetrieverError``); with one,
        an outage is declared (new turns wait, ``wait_available``) until it lasts ``max_outage_s``
        (``RetrieverOutageError``)."""
        if attempt <= self.max_retries:
            return
        if self.max_outage_s <= 0:
            self.num_failures += 1
            raise RetrieverError(f"retriever {self.url} failed after {attempt} attempts: {err}")
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = now
            self._available.clear()
            log.error(
                "retriever %s unreachable after %d attempts (%s): holding new turns until it answers "
                "(agentloop.tool.max_outage_s = %g)",
                self.url,
                attempt,
                err,
                self.max_outage_s,
            )
        if now - self.down_since >= self.max_outage_s:
            self.num_failures += 1
            raise RetrieverOutageError(
                f"retriever {self.url} unreachable for {now - self.down_since:.0f}s (agentloop.tool.max_outage_s = "
                f"{self.max_outage_s:g}), last error: {err}; restart it or point agentloop.tool.retriever_url at a "
                f"live one, then resume from the last checkpoint"
            )

    def _outage_ends(self) -> None:
        if self.down_since is not None:
            log.warning(
                "retriever %s answers again after %.1fs; new turns resume", self.url, time.monotonic() - self.down_since
            )
            self.down_since = None
            self._available.set()

    async def _post(self, payload: dict, num_queries: int) -> list[list[dict]]:
        async with self._get_session().post(self.url, json=payload) as resp:
            body = await self._read_body(resp)
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}: {body[:200].decode('utf-8', 'replace')}")
        try:
            result = json.loads(body)["result"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise ValueError(f"malformed response (no 'result'): {body[:200].decode('utf-8', 'replace')}") from None
        if not isinstance(result, list) or len(result) != num_queries:
            got = f"{len(result)} entries" if isinstance(result, list) else type(result).__name__
            raise ValueError(f"malformed response: 'result' must be a list of {num_queries} result lists, got {got}")
        docs = []
        for i, row in enumerate(result):
            if not isinstance(row, list):
                raise ValueError(
                    f"malformed response: 'result[{i}]' must be a list of documents, got {type(row).__name__} "
                    f"{row!r:.80}"
                )
            docs.append([_as_doc(entry, f"result[{i}][{j}]") for j, entry in enumerate(row)])
        return docs

    async def _read_body(self, resp: aiohttp.ClientResponse) -> bytes:
        """The body, at most ``MAX_RESPONSE_BYTES`` of it (checked against Content-Length first, then while
        reading: a chunked body has none)."""
        cap = MAX_RESPONSE_BYTES
        too_large = f"response body over {cap} bytes (MAX_RESPONSE_BYTES)"
        if resp.content_length is not None and resp.content_length > cap:
            raise ValueError(f"{too_large}: Content-Length {resp.content_length}")
        chunks, size = [], 0
        async for chunk in resp.content.iter_chunked(1 << 20):
            size += len(chunk)
            if size > cap:
                raise ValueError(too_large)
            chunks.append(chunk)
        return b"".join(chunks)

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()


def _as_doc(entry: object, where: str) -> dict:
    """A result entry with or without scores -> the document dict (with a string ``contents``)."""
    if not isinstance(entry, dict):
        raise ValueError(f"malformed response: '{where}' is a {type(entry).__name__}, not an object")
    doc = entry["document"] if "document" in entry else entry
    if not isinstance(doc, dict) or "contents" not in doc:
        raise ValueError(f"malformed response: '{where}' has no document 'contents'")
    if not isinstance(doc["contents"], str):
        raise ValueError(
            f"malformed response: '{where}': 'contents' must be a string, got {type(doc['contents']).__name__}"
        )
    return doc
