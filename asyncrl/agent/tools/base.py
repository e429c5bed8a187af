"""The retriever interface both implementations share (``bm25``, ``http``) and its one error type.

class MyRetriever:  # satisfies Retriever
    name = "my-index"
    async def retrieve(self, queries, topk): ...
    async def close(self): ...
"""

from __future__ import annotations

from typing import Protocol


class RetrieverError(RuntimeError):
    """A retrieval failed for good (after retries); the message names the URL or corpus."""


class Retriever(Protocol):
    name: str
    """Where results come from (the URL, or ``bm25:<corpus path>``): used in error messages."""

    async def retrieve(self, queries: list[str], topk: int) -> list[list[dict]]: ...

    async def close(self) -> None: ...
