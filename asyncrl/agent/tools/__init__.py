"""Retrievers: one async interface, two implementations, chosen by ``agentloop.tool.retriever``.

- ``bm25``: ``BM25Retriever`` (bm25s, in process) over a Search-R1 JSONL corpus
  (``{"id", "contents": "Title\\ntext"}``);
- ``http``: ``HttpRetriever``, a client of Search-R1's ``POST /retrieve`` (batched queries, a
  timeout per call, retries with exponential backoff; after the last retry a ``RetrieverError``
  naming the URL, which aborts the trajectory).

Both return, per query, the top-k documents as ``{"id", "contents", ...}`` dicts, best first.

    retriever = make_retriever(cfg.agentloop.tool)
    docs = await retriever.retrieve(["capital of Zorvania"], topk=3)   # [[{"id": ..., "contents": ...}, ...]]
"""

from __future__ import annotations

from typing import Protocol

from asyncrl.config.schema import ToolConfig


class RetrieverError(RuntimeError):
    """A retrieval failed for good (after retries); the message names the URL or corpus."""


class Retriever(Protocol):
    name: str
    """Where results come from (the URL, or ``bm25:<corpus path>``): used in error messages."""

    async def retrieve(self, queries: list[str], topk: int) -> list[list[dict]]: ...

    async def close(self) -> None: ...


def make_retriever(tool: ToolConfig) -> Retriever:
    """The retriever ``tool.retriever`` names, built from the tool settings."""
    if tool.retriever == "bm25":
        if not tool.corpus_path:
            raise ValueError("agentloop.tool.corpus_path: required when agentloop.tool.retriever = 'bm25'")
        from asyncrl.agent.tools.bm25 import BM25Retriever

        return BM25Retriever.from_jsonl(tool.corpus_path)
    if tool.retriever == "http":
        if not tool.retriever_url:
            raise ValueError("agentloop.tool.retriever_url: required when agentloop.tool.retriever = 'http'")
        from asyncrl.agent.tools.http_retriever import HttpRetriever

        return HttpRetriever(tool.retriever_url, timeout_s=tool.timeout_s, max_retries=tool.max_retries,
                             backoff_s=tool.retry_backoff_s)
    raise ValueError(f"agentloop.tool.retriever: unknown retriever {tool.retriever!r} (bm25 | http)")
