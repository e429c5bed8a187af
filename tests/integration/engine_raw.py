"""Raw HTTP calls to an engine's control endpoints, for tests.

The production client (``asyncrl.engine.client.SGLangClient``) has only the calls production makes (generate,
weights from disk, model info); the weight sync, the scraper and the launcher use ``asyncrl.engine.blocking``.
Tests that drive the rest of the protocol (pause modes, the weight-update group, ``/metrics``) make the calls
themselves, here: one aiohttp request per call, a deadline on each, and the one error type.

    raw = RawEngine(url)
    await raw.post("/pause_generation", {"mode": "retract"})
    (await raw.metrics())["num_retracted_reqs"]
"""

from __future__ import annotations

import json
from typing import Any, Optional

import aiohttp

from asyncrl.engine.client import EngineError, parse_prometheus


class RawEngine:
    def __init__(self, url: str, *, timeout_s: float = 60.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    async def call(self, method: str, path: str, body: Any = None, *, timeout_s: Optional[float] = None) -> Any:
        """The answer as JSON (or text); HTTP >= 400 and ``{"success": false}`` raise ``EngineError``."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s if timeout_s is None else timeout_s)
        async with aiohttp.ClientSession() as s:
            async with s.request(method, self.url + path, json=body, timeout=timeout) as r:
                status, text = r.status, await r.text()
        if status >= 400:
            raise EngineError(self.url, path, text, status)
        try:
            data = json.loads(text)
        except ValueError:
            return text
        if isinstance(data, dict) and data.get("success") is False:
            raise EngineError(self.url, path, str(data.get("message", data)), status)
        return data

    async def post(self, path: str, body: Optional[dict] = None, *, timeout_s: Optional[float] = None) -> Any:
        return await self.call("POST", path, {} if body is None else body, timeout_s=timeout_s)

    async def get(self, path: str) -> Any:
        return await self.call("GET", path)

    async def metrics(self) -> dict[str, float]:
        """``/metrics`` through the production reader (``sglang:`` series by name, without the prefix)."""
        return parse_prometheus(await self.call("GET", "/metrics"))
