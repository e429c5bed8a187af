"""One engine as the agent loop sees it: ``EngineHandle.generate`` (bounded in flight) and its answer as the loop
uses it (``GenOutput``: output ids, rollout log-probs, the integer weight version of each token).

    engine = EngineHandle(SGLangClient(url), max_in_flight=32)
    out = await engine.generate([1, 2, 3], {"max_new_tokens": 16}, rid="g0-s0-t0")
    out.output_ids, out.logprobs, out.versions, out.finish_type

Every failure is ``asyncrl.engine.client.EngineError`` naming the URL; the answer is parsed by the engine
package's one ``/generate`` parser.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from asyncrl.engine.client import EngineError, GenerateResult, decode_routed_experts
from asyncrl.engine.client import parse_generate_response as parse_reply

# ---------------------------------------------------------------- one generate call, parsed


@dataclass
class GenOutput:
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    """Weight version of each output token."""
    finish_type: str
    """``stop``, ``length`` or ``abort``."""
    finish_matched: Any = None
    """For ``stop``: the stop string (str) or token id (int, e.g. EOS)."""
    num_retractions: int = 0
    cached_tokens: int = 0
    routed_experts: Optional[np.ndarray] = None
    """Asked for (``routed_from``): the experts of positions ``routed_from .. prompt + output - 2``, ``[rows,
    layers * top-k]`` int32 (``asyncrl.engine.client.decode_routed_experts``)."""


def parse_version(value: Any, url: str) -> int:
    """SGLang weight versions are strings; ours are integers (``default`` = 0)."""
    if isinstance(value, int):
        return value
    if value is None or value == "default":
        return 0
    try:
        return int(str(value))
    except ValueError:
        raise EngineError(
            url, "/generate", f"weight version {value!r} is not an integer; launch engines with --weight-version 0"
        ) from None


def token_versions(meta: dict, num_tokens: int, url: str) -> list[int]:
    """Per-output-token versions from ``weight_versions`` spans, else ``weight_version``.

    A span ``{"version", "start", "end"}`` covers output tokens ``start <= j < end``; tokens no
    span covers get ``weight_version``.
    """
    default = parse_version(meta.get("weight_version"), url)
    versions = [default] * num_tokens
    for span in meta.get("weight_versions") or ():
        v = parse_version(span.get("version"), url)
        start, end = max(0, int(span.get("start", 0))), min(num_tokens, int(span.get("end", num_tokens)))
        for j in range(start, end):
            versions[j] = v
    return versions


def gen_output(
    result: GenerateResult, url: str, *, prompt_len: int = 0, routed_from: Optional[int] = None
) -> GenOutput:
    """The engine client's typed answer as the loop uses it: log-probs required (``return_logprob``), the
    weight version of each output token as an integer; with ``routed_from``, the routed experts of the positions
    from there to the last but one (of ``prompt_len`` prompt and the output tokens), required."""
    if result.output_logprobs is None:
        raise EngineError(url, "/generate", "/generate reply has no output_token_logprobs (return_logprob)")
    routed = None
    # a request aborted while it waited has no rows (SGLang answers no key): the next request asks again from there
    waited = result.aborted and not result.output_ids and "routed_experts" not in result.meta_info
    if routed_from is not None and not waited:
        rows = prompt_len + len(result.output_ids) - 1 - routed_from
        routed = decode_routed_experts(result.meta_info, max(rows, 0), url)
    finish = result.finish_reason
    return GenOutput(
        output_ids=result.output_ids,
        logprobs=result.output_logprobs,
        versions=token_versions(result.meta_info, len(result.output_ids), url),
        finish_type=str(finish.get("type", "")),
        finish_matched=finish.get("matched"),
        num_retractions=result.num_retractions,
        cached_tokens=result.cached_tokens,
        routed_experts=routed,
    )


class EngineHandle:
    """One engine as the loop sees it: ``generate`` with at most ``max_in_flight`` calls at once.

    ``client`` is the engine's ``asyncrl.engine.client.SGLangClient`` (its typed answer is used as is);
    ``generate_raw`` (tests, other transports) replaces its ``generate`` by a coroutine ``(input_ids,
    sampling_params, rid, **routing) -> raw /generate JSON`` (``routing``: ``routed_experts_start_len`` when
    asked), parsed by the same client parser. Any failure (client error, timeout, HTTP status, malformed reply) is
    ``asyncrl.engine.client.EngineError`` naming the URL.
    """

    def __init__(
        self,
        client: Any,
        *,
        max_in_flight: int,
        url: Optional[str] = None,
        generate_raw: Optional[Callable[..., Awaitable[dict]]] = None,
    ):
        self.client = client
        self.url = url or getattr(client, "url", None) or getattr(client, "base_url", "?")
        self.max_in_flight = max_in_flight
        self._sem = asyncio.Semaphore(max_in_flight)
        self._generate_raw = generate_raw
        self.in_flight = 0
        """Generate calls in flight now."""
        self.load = 0
        """Trajectories assigned now (for least-loaded placement of groups)."""

    async def _call(self, input_ids, sampling_params, rid, routing: dict) -> GenerateResult:
        if self._generate_raw is not None:
            return parse_reply(await self._generate_raw(input_ids, sampling_params, rid, **routing), self.url)
        return await self.client.generate(input_ids, sampling_params, rid=rid, return_logprob=True, **routing)

    async def generate(
        self, input_ids: list[int], sampling_params: dict, *, rid: str, routed_from: Optional[int] = None
    ) -> GenOutput:
        """One ``/generate``; ``routed_from``: also the routed experts of the positions from there on."""
        routing = {} if routed_from is None else {"routed_experts_start_len": routed_from}
        async with self._sem:
            self.in_flight += 1
            try:
                result = await self._call(input_ids, sampling_params, rid, routing)
            except EngineError:
                raise
            except (asyncio.TimeoutError, OSError, ValueError, RuntimeError) as exc:  # a generate_raw transport
                raise EngineError(self.url, "/generate", f"generate failed: {type(exc).__name__}: {exc}") from exc
            finally:
                self.in_flight -= 1
        return gen_output(result, self.url, prompt_len=len(input_ids), routed_from=routed_from)
