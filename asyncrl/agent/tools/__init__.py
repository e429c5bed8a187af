"""Retrievers: one async interface, two implementations, chosen by ``agentloop.tool.retriever``.

- ``bm25``: ``BM25Retriever`` (bm25s, in process) over a Search-R1 JSONL corpus
  (``{"id", "contents": "Title\\ntext"}``);
- ``http``: ``HttpRetriever``, a client of Search-R1's ``POST /retrieve`` (batched queries, a
  timeout per call, retries with exponential backoff; after the last retry a ``RetrieverError``
  naming the URL, which aborts the trajectory).

Both return, per query, the top-k documents as ``{"id", "contents", ...}`` dicts, best first.

    retriever = make_retriever(cfg.agentloop.tool)
    docs = await retriever.retrieve(["capital of Zorvania"], topk=3)   # [[{"id": ..., "contents": ...}, ...]]
    check_retriever(cfg.agentloop.tool, role="rollout rank 8")          # at start, from every role calling it

``check_retriever`` makes one real ``/retrieve`` call (one attempt, ``timeout_s``) so an unreachable URL
fails the start naming the URL and the role, not the first trajectories.
"""

from __future__ import annotations

import asyncio

from asyncrl.agent.tools.base import Retriever, RetrieverError, RetrieverOutageError
from asyncrl.agent.tools.bm25 import BM25Retriever
from asyncrl.agent.tools.http_retriever import HttpRetriever
from asyncrl.config.schema import ToolConfig

__all__ = [
    "BM25Retriever",
    "HttpRetriever",
    "Retriever",
    "RetrieverError",
    "RetrieverOutageError",
    "check_retriever",
    "make_retriever",
]


def make_retriever(tool: ToolConfig) -> Retriever:
    """The retriever ``tool.retriever`` names, built from the tool settings."""
    if tool.retriever == "bm25":
        if not tool.corpus_path:
            raise ValueError("agentloop.tool.corpus_path: required when agentloop.tool.retriever = 'bm25'")
        return BM25Retriever.from_jsonl(tool.corpus_path)
    if tool.retriever == "http":
        if not tool.retriever_url:
            raise ValueError("agentloop.tool.retriever_url: required when agentloop.tool.retriever = 'http'")
        return HttpRetriever(
            tool.retriever_url,
            timeout_s=tool.timeout_s,
            max_retries=tool.max_retries,
            backoff_s=tool.retry_backoff_s,
            max_outage_s=tool.max_outage_s,
        )
    raise ValueError(f"agentloop.tool.retriever: unknown retriever {tool.retriever!r} (bm25 | http)")


def check_retriever(tool: ToolConfig, *, role: str) -> None:
    """At start, from each role that calls the tool: one real request to every tool URL (the HTTP
    retriever; BM25 runs in process). Raises ``RetrieverError`` naming the URL and ``role``."""
    if tool.retriever != "http":
        return

    async def once() -> None:
        r = HttpRetriever(tool.retriever_url, timeout_s=tool.timeout_s, max_retries=0)
        try:
            await r.retrieve(["asyncrl start-up check"], topk=1)
        finally:
            await r.close()

    try:
        asyncio.run(once())
    except RetrieverError as e:
        raise RetrieverError(
            f"{role}: agentloop.tool.retriever_url {tool.retriever_url} does not answer a "
            f"/retrieve request: {e}; start the retriever where this node reaches it, or "
            f"point the URL at a host this node reaches"
        ) from None
