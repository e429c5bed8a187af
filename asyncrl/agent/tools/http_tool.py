"""Tools that live elsewhere, behind HTTP: the protocol, its server and ``HttpTool``, the client that is a ``Tool``.

Protocol (JSON bodies, UTF-8):

- ``GET /tools`` -> 200 ``{"tools": [{"name": str, "description": str, "parameters": <JSON schema>}, ...]}``
- ``POST /call`` with ``{"name": str, "arguments": {...}, "timeout_s": number (optional)}``:
  200 ``{"output": <any JSON value>}`` (the tool's result), or 200 ``{"error": str}`` (the tool raised ``ToolError``,
  or did not finish in ``timeout_s``: the policy sees the message); 404 ``{"error"}`` for a tool this server does not
  have (the message lists the ones it has); 400 ``{"error"}`` for a malformed request, naming the field (``name``,
  ``arguments``, ``timeout_s``); 503 ``{"error"}`` when the tool's own infrastructure failed (``ToolUnavailable``);
  500 when the tool raised anything else or returned what JSON cannot hold (a bug: the server logs it).
  ``timeout_s`` defaults to, and is capped at, the server's ``--max-timeout-s``; the server bounds each call by it.
- ``GET /health`` -> 200 ``{"status": "ok", "tools": [names]}``

Server, serving several tools in one process (``--port 0``: a free port; it prints one JSON line
``{"url": "http://host:port", "tools": [names]}`` once it listens; SIGTERM stops it, closing the tools):

    python -m asyncrl.agent.tools.http_tool --host 127.0.0.1 --port 8200 --tool python --tool calculator \\
        --tool my_pkg.tools:WeatherTool

``--tool``: ``python`` (``PythonTool()``), ``calculator`` (``CalculatorTool()``), or ``module:attr`` where ``attr``
is a Tool instance or a class/callable returning one (called without arguments). A spec that does not import or does
not give a Tool stops the server at start, naming the spec (exit code 2).

Client: one aiohttp session per ``HttpTool`` (closed by ``close()``), one POST per call with a deadline of
``min(timeout_s of the call, timeout_s of the tool)``; the server is asked to finish a little earlier
(``server_timeout_s``) so its own timeout message arrives. An ``{"error"}`` reply raises ``ToolError(message)``;
a refused connection, a timeout or a 5xx raise ``ToolError`` naming the URL ("tool server unreachable: <url>: ...",
"tool server <url> failed (HTTP 503): ..."): the policy sees it and it counts as a tool error.

    tools = await HttpTool.discover("http://127.0.0.1:8200", timeout_s=10.0)   # one HttpTool per served tool
    await tools[0].call({"code": "print(1)"}, timeout_s=10.0)                  # "1\\n"
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import logging
import re
import signal
import sys
from typing import Any

import aiohttp
from aiohttp import web

from asyncrl.agent.tools.base import Tool, ToolError, ToolUnavailable

log = logging.getLogger("asyncrl.tools.http")

TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
DEFAULT_MAX_TIMEOUT_S = 300.0  # a tool call the policy waits for: minutes at most
MAX_REQUEST_BYTES = 16 << 20  # a call's arguments (code, text) are KBs; 16 MB is not an argument
MAX_REPLY_CHARS = 400  # of a non-JSON reply quoted in an error


def server_timeout_s(budget_s: float) -> float:
    """What the client asks of the server: its budget less a margin for the network and the reply (pure)."""
    return budget_s - min(1.0, budget_s / 4)


# ---- the server's pure parts


def parse_call(body: object, *, max_timeout_s: float) -> tuple[str, dict, float]:
    """A /call body's (name, arguments, timeout_s); ValueError names the field and says what is wrong."""
    if not isinstance(body, dict):
        raise ValueError(f"body must be a JSON object, got {type(body).__name__}")
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"'name' must be a non-empty string, got {name!r:.80}")
    arguments = body.get("arguments", {})
    if not isinstance(arguments, dict):
        raise ValueError(f"'arguments' must be a JSON object, got {type(arguments).__name__}")
    timeout_s = body.get("timeout_s", max_timeout_s)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"'timeout_s' must be a number > 0, got {timeout_s!r:.80}")
    return name, arguments, min(float(timeout_s), max_timeout_s)


def check_tool(tool: object, spec: str) -> Tool:
    """``tool`` if it has what a Tool needs, else ValueError naming ``spec`` and the missing part."""
    name = getattr(tool, "name", None)
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise ValueError(f"--tool {spec}: 'name' must match [A-Za-z_][A-Za-z0-9_]*, got {name!r:.80}")
    if not isinstance(getattr(tool, "description", None), str):
        raise ValueError(f"--tool {spec}: 'description' must be a string")
    if not isinstance(getattr(tool, "parameters", None), dict):
        raise ValueError(f"--tool {spec}: 'parameters' must be a dict (a JSON schema)")
    for method in ("call", "close"):
        if not inspect.iscoroutinefunction(getattr(tool, method, None)):
            raise ValueError(f"--tool {spec}: '{method}' must be an async method")
    return tool  # type: ignore[return-value]


def load_tool(spec: str) -> Tool:
    """``python`` | ``calculator`` | ``module:attr`` (a Tool, or a class/callable giving one) -> the Tool."""
    if spec == "python":
        from asyncrl.agent.tools.python_sandbox import PythonTool

        return PythonTool()
    if spec == "calculator":
        from asyncrl.agent.tools.calculator import CalculatorTool

        return CalculatorTool()
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--tool {spec}: expected python | calculator | module:attr")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--tool {spec}: cannot import {module_name!r}: {exc}") from None
    if not hasattr(module, attr):
        raise ValueError(f"--tool {spec}: module {module_name!r} has no attribute {attr!r}")
    obj = getattr(module, attr)
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "call")):
        obj = obj()
    return check_tool(obj, spec)


def index_tools(tools: list[Tool]) -> dict[str, Tool]:
    by_name: dict[str, Tool] = {}
    for tool in tools:
        if tool.name in by_name:
            raise ValueError(f"--tool: two tools are named {tool.name!r}")
        by_name[tool.name] = tool
    return by_name


# ---- the server


def make_app(tools: dict[str, Tool], *, max_timeout_s: float = DEFAULT_MAX_TIMEOUT_S) -> web.Application:
    """The aiohttp app serving ``tools``; its cleanup closes them."""

    async def list_tools(request: web.Request) -> web.Response:
        described = [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in tools.values()]
        return web.json_response({"tools": described})

    async def call(request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, nesting too deep
            return web.json_response({"error": f"invalid JSON body: {exc}"}, status=400)
        try:
            name, arguments, timeout_s = parse_call(body, max_timeout_s=max_timeout_s)
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        tool = tools.get(name)
        if tool is None:
            return web.json_response({"error": f"unknown tool {name!r}; this server has {sorted(tools)}"}, status=404)
        try:
            output = await asyncio.wait_for(tool.call(arguments, timeout_s=timeout_s), timeout_s)
        except ToolError as exc:
            return web.json_response({"error": str(exc)})
        except asyncio.TimeoutError:
            return web.json_response({"error": f"{name}: timed out after {timeout_s:.1f} s"})
        except ToolUnavailable as exc:
            return web.json_response({"error": f"{name} unavailable: {exc}"}, status=503)
        try:
            text = json.dumps({"output": output})
        except (TypeError, ValueError) as exc:
            return web.json_response({"error": f"{name} returned what JSON cannot hold: {exc}"}, status=500)
        return web.Response(text=text, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "tools": sorted(tools)})

    async def close_tools(app: web.Application) -> None:
        for tool in tools.values():
            await tool.close()

    app = web.Application(client_max_size=MAX_REQUEST_BYTES)
    app.router.add_get("/tools", list_tools)
    app.router.add_post("/call", call)
    app.router.add_get("/health", health)
    app.on_cleanup.append(close_tools)
    return app


async def serve(tools: dict[str, Tool], *, host: str, port: int, max_timeout_s: float) -> None:
    """Serve until SIGTERM or SIGINT; prints the one start line (the bound URL)."""
    runner = web.AppRunner(make_app(tools, max_timeout_s=max_timeout_s), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # the real port when --port 0
    print(json.dumps({"url": f"http://{host}:{bound}", "tools": sorted(tools)}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncrl.agent.tools.http_tool", description="tools over HTTP")
    ap.add_argument("--tool", action="append", required=True, help="python | calculator | module:attr (repeatable)")
    ap.add_argument("--port", type=int, required=True, help="TCP port (0 = any free port)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--max-timeout-s", type=float, default=DEFAULT_MAX_TIMEOUT_S, help="longest call allowed")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        tools = index_tools([load_tool(spec) for spec in args.tool])
    except ValueError as exc:
        print(f"http_tool: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(tools, host=args.host, port=args.port, max_timeout_s=args.max_timeout_s))
    return 0


# ---- the client


class HttpTool:
    """A tool served by an ``http_tool`` server (any server speaking the protocol above), as a ``Tool``."""

    def __init__(
        self,
        url: str,
        name: str,
        *,
        timeout_s: float = 30.0,
        description: str = "",
        parameters: dict | None = None,
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"HttpTool: expected an http(s)://host:port URL, got {url!r}")
        if not TOOL_NAME.match(name):
            raise ValueError(f"HttpTool: name must match [A-Za-z_][A-Za-z0-9_]*, got {name!r}")
        if not timeout_s > 0:
            raise ValueError(f"HttpTool: timeout_s must be > 0, got {timeout_s!r}")
        self.url = url.rstrip("/")
        self.name = name
        self.timeout_s = float(timeout_s)
        self.description = description
        self.parameters = parameters if parameters is not None else {"type": "object"}
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    async def discover(cls, url: str, *, timeout_s: float = 10.0, call_timeout_s: float = 30.0) -> list[HttpTool]:
        """One HttpTool per tool ``GET /tools`` lists (each with ``call_timeout_s``); ToolUnavailable naming the
        URL when the server does not answer in ``timeout_s`` or answers something else."""
        tools_url = url.rstrip("/") + "/tools"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
                async with session.get(tools_url) as resp:
                    status, text = resp.status, await resp.text()
        except asyncio.TimeoutError:
            raise ToolUnavailable(f"tool server {tools_url}: no answer in {timeout_s:.1f} s") from None
        except aiohttp.ClientError as exc:
            raise ToolUnavailable(f"tool server {tools_url}: {type(exc).__name__}: {exc}") from None
        try:
            listed = json.loads(text)["tools"] if status == 200 else None
        except (ValueError, KeyError, TypeError):
            listed = None
        if not isinstance(listed, list):
            raise ToolUnavailable(f"tool server {tools_url}: HTTP {status}, no 'tools' list: {text[:MAX_REPLY_CHARS]}")
        found = []
        for i, entry in enumerate(listed):
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise ToolUnavailable(f"tool server {tools_url}: 'tools[{i}].name' must be a string")
            try:
                found.append(
                    cls(
                        url,
                        entry["name"],
                        timeout_s=call_timeout_s,
                        description=str(entry.get("description", "")),
                        parameters=entry.get("parameters") if isinstance(entry.get("parameters"), dict) else None,
                    )
                )
            except ValueError as exc:
                raise ToolUnavailable(f"tool server {tools_url}: 'tools[{i}]': {exc}") from None
        return found

    async def call(self, arguments: dict, *, timeout_s: float) -> Any:
        budget_s = min(self.timeout_s, timeout_s)
        call_url = self.url + "/call"
        body = {"name": self.name, "arguments": arguments, "timeout_s": server_timeout_s(budget_s)}
        try:
            payload = json.dumps(body)
        except (TypeError, ValueError) as exc:
            raise ToolError(f"{self.name}: arguments are not JSON: {exc}") from None
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        try:
            async with self._session.post(
                call_url,
                data=payload,
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=budget_s),
            ) as resp:
                status, text = resp.status, await resp.text()
        except asyncio.TimeoutError:
            raise ToolError(f"tool server unreachable: {call_url}: no answer in {budget_s:.1f} s") from None
        except aiohttp.ClientError as exc:
            raise ToolError(f"tool server unreachable: {call_url}: {type(exc).__name__}: {exc}") from None
        return self._reply(call_url, status, text)

    def _reply(self, call_url: str, status: int, text: str) -> Any:
        """The output of a /call reply, or ToolError saying what the server said (pure)."""
        try:
            reply = json.loads(text)
        except ValueError:
            reply = None
        error = reply.get("error") if isinstance(reply, dict) else None
        if status >= 500:
            raise ToolError(f"tool server {call_url} failed (HTTP {status}): {error or text[:MAX_REPLY_CHARS]}")
        if status != 200:
            raise ToolError(
                f"tool server {call_url} refused the call (HTTP {status}): {error or text[:MAX_REPLY_CHARS]}"
            )
        if isinstance(error, str):
            raise ToolError(error)
        if not isinstance(reply, dict) or "output" not in reply:
            raise ToolError(f"tool server {call_url}: a reply without 'output' or 'error': {text[:MAX_REPLY_CHARS]}")
        return reply["output"]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


if __name__ == "__main__":
    raise SystemExit(main())
