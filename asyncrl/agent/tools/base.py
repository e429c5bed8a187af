"""The retriever interface both implementations share (``bm25``, ``http``) and its one error type.

class MyRetriever:  # satisfies Retriever
    name = "my-index"
    async def retrieve(self, queries, topk, *, stats=None): ...
    async def wait_available(self): ...
    async def close(self): ...
"""

from __future__ import annotations

from typing import Protocol


class RetrieverError(RuntimeError):
    """A retrieval failed for good (after retries); the message names the URL or corpus."""


class RetrieverOutageError(RetrieverError):
    """The retriever stayed unreachable for ``agentloop.tool.max_outage_s``: fatal for the worker (the run fails
    naming the URL) rather than one aborted trajectory."""


class Retriever(Protocol):
    name: str
    """Where results come from (the URL, or ``bm25:<corpus path>``): used in error messages."""

    async def retrieve(self, queries: list[str], topk: int, *, stats: dict | None = None) -> list[list[dict]]: ...

    async def wait_available(self) -> None:
        """Blocks while the retriever is in a declared outage (new turns wait)."""

    async def close(self) -> None: ...
