"""Asyncio client for one SGLang server (or the CPU engine, which speaks the same API).

Contract
- One ``SGLangClient`` per engine URL; it owns one pooled ``aiohttp.ClientSession`` (created
  lazily inside the running loop; ``close()`` or ``async with`` releases it).
- Its calls are the ones production makes from asyncio code: ``generate`` (the agent worker, the evaluator,
  the eval fleet's probe), ``update_weights_from_disk`` and ``model_info`` / ``weight_version`` (the eval
  fleet). The weight sync, the metrics scraper and the launcher's probes call from threads, through
  ``asyncrl.engine.blocking``; tests that drive the rest of the protocol make their own raw calls.
- Every call has a timeout: ``request_timeout_s`` for ``/generate``, ``control_timeout_s`` for
  everything else (both overridable per call, ``timeout_s``).
- Every failure raises ``EngineError`` carrying ``url``, ``endpoint``, ``status`` (None for
  connection errors and timeouts) and the server's ``message``; an SGLang ``{"success": false}``
  answer is a failure too.
- ``generate`` is token-in/token-out: it sends ``input_ids`` and returns the output ids exactly as
  the engine produced them (untrimmed), never re-tokenized.

    async with SGLangClient("http://127.0.0.1:30000") as c:
        r = await c.generate([1, 2, 3], {"max_new_tokens": 16, "temperature": 1.0})
        r.output_ids, r.output_logprobs, r.finish_reason["type"], r.weight_versions
        await c.update_weights_from_disk("runs/x/snapshot", weight_version="3"); await c.weight_version()
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, get_args

import aiohttp
import numpy as np

from asyncrl.cluster.auth import auth_headers
from asyncrl.config.schema import PAUSE_MODES

PauseMode = Literal["abort", "retract", "in_place"]
ENGINE_PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)
"""What an engine's ``/pause_generation`` accepts (``rollout.pause_mode`` less the trainer's ``drain``)."""
assert set(ENGINE_PAUSE_MODES) == set(PAUSE_MODES) - {"drain"}


class EngineError(RuntimeError):
    """An engine call failed. ``status`` is the HTTP status (None: no answer / timeout)."""

    def __init__(self, url: str, endpoint: str, message: str, status: Optional[int] = None):
        self.url = url
        self.endpoint = endpoint
        self.status = status
        self.message = message
        where = f"{url.rstrip('/')}{endpoint}"
        super().__init__(f"{where}: " + (f"HTTP {status}: " if status is not None else "") + message)


@dataclass(frozen=True)
class GenerateResult:
    """One ``/generate`` answer, typed. ``output_ids`` are untrimmed (stop tokens included)."""

    rid: str
    output_ids: list[int]
    output_logprobs: Optional[list[float]]
    """Log-prob of each output token (None unless ``return_logprob``)."""
    finish_reason: dict
    """``{"type": "stop", "matched": id|str}``, ``{"type": "length", "length": N}`` or
    ``{"type": "abort", "message": ...}``."""
    weight_version: str
    """The engine's weight version when the request finished."""
    weight_versions: list[dict]
    """``[{"version", "start", "end"}]``: which output tokens came from which version (may be empty
    on SGLang < 0.5.19)."""
    num_retractions: int
    text: str
    prompt_tokens: int
    cached_tokens: int
    meta_info: dict = field(repr=False)
    """The raw ``meta_info`` (e.g. ``input_token_logprobs``, ``e2e_latency``)."""

    @property
    def aborted(self) -> bool:
        return self.finish_reason.get("type") == "abort"

    @property
    def versions(self) -> list[str]:
        """Distinct weight versions this output was generated with, in order."""
        out: list[str] = []
        for w in self.weight_versions:
            if w["version"] not in out:
                out.append(w["version"])
        return out or [self.weight_version]


def parse_generate_response(data: Any, url: str = "") -> GenerateResult:
    """A ``/generate`` answer -> ``GenerateResult``. A malformed answer, or log-probs that are not one per
    output id (each entry ``[logprob, token_id, ...]`` for the id at its position), raise ``EngineError``
    naming ``url``."""
    try:
        meta = data.get("meta_info") or {}
        output_ids = [int(t) for t in data.get("output_ids") or []]
        lps = meta.get("output_token_logprobs")
        logprobs = None if lps is None else [float(x[0]) for x in lps]
        lp_ids = None if lps is None else [int(x[1]) for x in lps]
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:
        raise EngineError(url, "/generate", f"malformed /generate reply ({exc!r})") from None
    if lp_ids is not None:
        if len(lp_ids) != len(output_ids):
            raise EngineError(url, "/generate", f"{len(lp_ids)} log-probs for {len(output_ids)} output ids")
        for j, (a, b) in enumerate(zip(lp_ids, output_ids)):
            if a != b:
                raise EngineError(url, "/generate", f"log-prob {j} is for token {a}, output id is {b}")
    return GenerateResult(
        rid=str(meta.get("id", "")),
        output_ids=output_ids,
        output_logprobs=logprobs,
        finish_reason=meta.get("finish_reason") or {},
        weight_version=str(meta.get("weight_version", "")),
        weight_versions=list(meta.get("weight_versions") or []),
        num_retractions=int(meta.get("num_retractions", 0) or 0),
        text=data.get("text", ""),
        prompt_tokens=int(meta.get("prompt_tokens", 0) or 0),
        cached_tokens=int(meta.get("cached_tokens", 0) or 0),
        meta_info=meta,
    )


def decode_routed_experts(meta: dict, rows: int, url: str = "") -> np.ndarray:
    """``meta_info["routed_experts"]`` (SGLang's base64 of the int32 ``[positions, layers, top-k]`` array, positions
    ``routed_experts_start_len .. prompt + output - 2``) as ``[rows, layers * top-k]`` int32 (read-only). Raises
    ``EngineError`` naming ``url`` when it is missing, not base64, or not ``rows`` rows of one width."""
    value = meta.get("routed_experts")
    if not isinstance(value, str):
        raise EngineError(
            url,
            "/generate",
            f"reply has no routed_experts (got {type(value).__name__}); "
            "the engine needs --enable-return-routed-experts",
        )
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EngineError(url, "/generate", f"routed_experts is not base64 ({exc})") from None
    n = len(raw) // 4
    if len(raw) % 4 or (rows and n % rows) or (not rows and n):
        raise EngineError(url, "/generate", f"routed_experts: {len(raw)} bytes are not {rows} rows of int32")
    if rows and not n:
        raise EngineError(url, "/generate", f"routed_experts: empty, {rows} rows expected")
    return np.frombuffer(raw, np.dtype("<i4")).reshape(rows, n // rows if rows else 0)


_SAMPLE = re.compile(r"^sglang:([A-Za-z_][A-Za-z0-9_]*)(\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """``sglang:*`` samples -> {name: value}. Gauges/counters reported per label set (TP/DP
    ranks) are combined: counters summed, ``num_*``/``token_usage`` summed, rates averaged."""
    acc: dict[str, list[float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            acc.setdefault(m.group(1), []).append(float(m.group(3)))
        except ValueError:
            continue
    out: dict[str, float] = {}
    for name, vals in acc.items():
        out[name] = sum(vals) / len(vals) if name.endswith("_rate") else sum(vals)
    return out


def weight_version_note(version: str) -> str:
    """What SGLang appends to the message of a successful weight update that carried ``weight_version``
    (``update_weights_from_distributed`` / ``_from_disk``: the version is set only once the update succeeded);
    the CPU engine appends the same."""
    return f" Weight version updated to {version}."


def confirms_weight_version(answer: Any, version: str) -> bool:
    """Whether an update's answer says it succeeded AND set ``version`` (``weight_version_note``). An engine
    that ignores the field (an SGLang older than it) answers success without the note: not confirmed."""
    return (
        isinstance(answer, dict)
        and answer.get("success") is True
        and weight_version_note(version) in str(answer.get("message", ""))
    )


def parse_engine_load(metrics_text: str) -> Optional[float]:
    """Running + queued requests from a Prometheus ``/metrics`` page (None if it reports neither)."""
    vals = parse_prometheus(metrics_text)
    found = [vals[k] for k in ("num_running_reqs", "num_queue_reqs") if k in vals]
    return sum(found) if found else None


class SGLangClient:
    def __init__(
        self,
        url: str,
        *,
        request_timeout_s: float = 600.0,
        control_timeout_s: float = 60.0,
        max_connections: int = 1024,
    ):
        self.url = url.rstrip("/")
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.max_connections = max_connections
        self._session: Optional[aiohttp.ClientSession] = None

    @classmethod
    def from_config(cls, url: str, rollout_cfg) -> SGLangClient:
        """Timeouts from ``asyncrl.config.schema.RolloutConfig``."""
        return cls(
            url,
            request_timeout_s=rollout_cfg.request_timeout_s,
            control_timeout_s=rollout_cfg.control_timeout_s,
            max_connections=max(64, 2 * rollout_cfg.max_running_requests),
        )

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(  # the run secret, as SGLang's --api-key wants it
                connector=aiohttp.TCPConnector(limit=self.max_connections, force_close=False), headers=auth_headers()
            )
        return self._session

    # ---- transport -----------------------------------------------------------------------
    async def _request(
        self, method: str, endpoint: str, body: Any = None, *, timeout_s: Optional[float] = None, want: str = "json"
    ) -> Any:
        t = self.control_timeout_s if timeout_s is None else timeout_s
        try:
            async with self._sess().request(
                method,
                self.url + endpoint,
                json=body,
                timeout=aiohttp.ClientTimeout(total=t),
            ) as resp:
                raw = await resp.read()
                text = raw.decode(errors="replace")
                if resp.status >= 400:
                    raise EngineError(self.url, endpoint, _server_message(text), resp.status)
                if want == "text":
                    return text
                if want == "none" or not raw:
                    return None
                try:
                    return json.loads(raw)
                except json.JSONDecodeError:
                    raise EngineError(self.url, endpoint, f"non-JSON answer: {text[:500]!r}", resp.status) from None
        except asyncio.TimeoutError:
            raise EngineError(self.url, endpoint, f"no answer within {t:g}s (timeout)") from None
        except aiohttp.ClientError as e:
            raise EngineError(self.url, endpoint, f"{type(e).__name__}: {e}") from e

    async def _control(self, endpoint: str, body: Any, *, timeout_s: Optional[float] = None) -> dict:
        """A call answering ``{"success", "message"}``; success false raises."""
        data = await self._request("POST", endpoint, body, timeout_s=timeout_s)
        if isinstance(data, dict) and data.get("success") is False:
            raise EngineError(self.url, endpoint, str(data.get("message", data)), 200)
        return data or {}

    # ---- generation ----------------------------------------------------------------------
    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Optional[dict] = None,
        *,
        rid: Optional[str] = None,
        return_logprob: bool = True,
        logprob_start_len: Optional[int] = None,
        routed_experts_start_len: Optional[int] = None,
        timeout_s: Optional[float] = None,
    ) -> GenerateResult:
        """POST /generate for one prompt of token ids. An aborted request is returned (not raised):
        check ``result.aborted``. ``logprob_start_len >= 0`` also asks for prompt log-probs
        (``meta_info["input_token_logprobs"]``); ``routed_experts_start_len`` (an engine started with
        ``--enable-return-routed-experts``) for the routed experts of positions from there on
        (``meta_info["routed_experts"]``, ``decode_routed_experts``)."""
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
            "stream": False,
        }
        if rid is not None:
            body["rid"] = rid
        if logprob_start_len is not None:
            body["logprob_start_len"] = logprob_start_len
        if routed_experts_start_len is not None:
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = routed_experts_start_len
        data = await self._request(
            "POST", "/generate", body, timeout_s=self.request_timeout_s if timeout_s is None else timeout_s
        )
        if isinstance(data, list):  # n > 1 in sampling_params: take the first, keep all raw
            data = data[0]
        return parse_generate_response(data, self.url)

    # ---- weights and info --------------------------------------------------------------
    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        load_format: Optional[str] = None,
        weight_version: Optional[str] = None,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
        timeout_s: Optional[float] = None,
    ) -> dict:
        """POST /update_weights_from_disk: load the HF checkpoint at ``model_path`` (a path on the engine's
        host) into the running engine; ``weight_version`` (when given) becomes the engine's version."""
        body: dict[str, Any] = {
            "model_path": str(model_path),
            "load_format": load_format,
            "abort_all_requests": abort_all_requests,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._control("/update_weights_from_disk", body, timeout_s=timeout_s)

    async def model_info(self, *, timeout_s: Optional[float] = None) -> dict:
        """GET /model_info (falls back to /get_model_info on older SGLang)."""
        try:
            return await self._request("GET", "/model_info", timeout_s=timeout_s)
        except EngineError as e:
            if e.status != 404:
                raise
            return await self._request("GET", "/get_model_info", timeout_s=timeout_s)

    async def weight_version(self) -> str:
        return str((await self.model_info())["weight_version"])


def _server_message(text: str) -> str:
    """The server's error message from ``{"error": {"message"}}``, ``{"error": "..."}``,
    ``{"message"}``, FastAPI's ``{"detail"}`` or plain text."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:2000] or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        for k in ("message", "detail"):
            if k in data:
                return str(data[k])
    return text.strip()[:2000]
