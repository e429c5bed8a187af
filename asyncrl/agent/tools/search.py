"""The ``search`` tool: a retriever (``bm25`` or ``http``, ``agentloop.tool``) as a tool of the agent loop.

Contract
- ``SearchTool(retriever, topk)``: ``call({"query": q})`` returns the top-``topk`` documents of ``q`` (``{"id",
  "contents"}`` dicts, best first); the environment formats them (Search-R1's ``<information>`` block). It bounds
  itself: the HTTP retriever's per-attempt timeout, retries and outage budget (``timeout_s`` is None, so the agent
  loop adds no deadline of its own). A retrieval that fails after its retries raises ``RetrieverError`` (a
  ``ToolUnavailable``: the trajectory is aborted, its group retried); an outage holds new turns
  (``wait_available``) and past its budget raises ``RetrieverOutageError`` (the worker fails naming the URL).
- Failed retrieval attempts of the current trajectory are counted in the dict ``call_stats()`` returns, which the
  agent loop sets per trajectory (``extra["tool_errors"]``, the metric ``tool/errors``).

    tool = SearchTool(BM25Retriever.from_jsonl("corpus.jsonl"), topk=3)
    docs = await tool.call({"query": "capital of Zorvania"}, timeout_s=30)
"""

from __future__ import annotations

import contextvars
from typing import Any, Optional

from asyncrl.agent.tools.base import Retriever, ToolError

_STATS: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("asyncrl_tool_stats", default=None)


def call_stats() -> contextvars.ContextVar[Optional[dict]]:
    """The context variable holding the running trajectory's tool counters (set by the agent loop)."""
    return _STATS


class SearchTool:
    name = "search"
    description = "Search the knowledge source; returns the best matching documents."
    parameters = {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "what to search for"}},
        "required": ["query"],
    }
    timeout_s = None
    """The retriever bounds each call itself (per-attempt timeout, retries, outage budget)."""

    def __init__(self, retriever: Retriever, topk: int):
        self.retriever = retriever
        self.topk = topk

    async def call(self, arguments: dict, *, timeout_s: Optional[float] = None) -> Any:
        query = arguments.get("query")
        if not isinstance(query, str):
            raise ToolError('search needs a "query" string')
        return (await self.retriever.retrieve([query], self.topk, stats=_STATS.get()))[0]

    async def wait_available(self) -> None:
        await self.retriever.wait_available()

    async def close(self) -> None:
        await self.retriever.close()
