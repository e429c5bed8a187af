"""The tool interface every tool satisfies (``Tool``, its two error types), and the retriever interface both
retrievers share (``bm25``, ``http``) with its errors.

Contract of a tool: ``call`` returns the result (the environment formats it into observation text) or raises
``ToolError`` (the policy sees the message) or ``ToolUnavailable`` (the trajectory is aborted and the group retried),
within ``timeout_s``; ``close`` releases what the tool holds (sessions, processes).

class Echo:  # satisfies Tool
    name = "echo"
    description = "Repeats its text."
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    async def call(self, arguments, *, timeout_s): return arguments["text"]
    async def close(self): ...

class MyRetriever:  # satisfies Retriever
    name = "my-index"
    async def retrieve(self, queries, topk, *, stats=None): ...
    async def wait_available(self): ...
    async def close(self): ...
"""

from __future__ import annotations

from typing import Any, Protocol


class ToolError(RuntimeError):
    """A tool call failed in a way the policy should see: the message becomes the observation (and counts in the
    metric tool/<name>/errors). Never aborts the trajectory."""


class ToolUnavailable(RuntimeError):
    """The tool's infrastructure failed (not the call's arguments): the trajectory is aborted, never scored, and
    the broker retries the group (RetrieverError is one)."""


class Tool(Protocol):
    name: str
    """What the model calls it by (a tag name or a function name): [A-Za-z_][A-Za-z0-9_]*"""
    description: str
    parameters: dict
    """JSON schema of the arguments object, e.g. {"type": "object", "properties": {"code": {"type": "string"}},
    "required": ["code"]}"""

    async def call(self, arguments: dict, *, timeout_s: float) -> Any:
        """The result (the environment formats it into observation text; str is the common case). Raises ToolError
        for a failure the policy should see. Must return or raise within timeout_s (the agent loop also enforces
        it with asyncio.wait_for and counts a timeout as an error)."""

    async def close(self) -> None: ...


class RetrieverError(ToolUnavailable):
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
