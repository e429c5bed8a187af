"""Served weights are checked, not assumed: after a sync, a few parameters read back from every engine
(SGLang's ``/get_weights_by_name``) must equal what the actor sent.

Why: SGLang's loaders only warn on a parameter name they do not know and the update still answers success, so a
name drift (another model family, a Megatron rename) would train against engines serving their initial weights
with every version check green.

Contract
- Pure core: ``SentRows`` records the first ``PROBE_ROWS`` rows of every tensor as the sync's buckets stream by
  (``capture`` wraps the bucket iterator); ``probe_names`` picks the parameters to read back (every one that no
  layer index names: embedding, final norm, head; and every one of the first and the last layer: attention, MLP,
  norms), at most ``MAX_PROBES``; ``same_values`` compares a served answer with what was sent (bit-equal in float32,
  or equal to the sent values rounded to bfloat16 or float16: an engine may hold another dtype).
- Shell: ``verify_engines(urls, sent, ...)`` asks every engine for every probe (``{"name", "truncate_size"}``; one
  thread per engine, each call bounded) and raises ``WeightVerifyError`` naming the engine and the parameter when a
  value differs, or when an engine that reads other parameters has none by that name (it was sent and dropped).
  An engine that reads none (SGLang 0.5.23 implements ``get_weights_by_name`` for Llama-family classes only: Qwen2
  and Qwen3 answer 400 "Get parameter by name failed" for every name) cannot be checked: the result says so.
- ``WeightVerifyError`` is not a ``RuntimeError``: the sync's recovery does not retry it (no restart fixes a name).

    sent = SentRows(); pushed = push(sent.capture(buckets)); res = verify_engines(urls, sent, timeout_s=60)
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch

from asyncrl.engine.blocking import EngineStepError, fan_out, post_json

log = logging.getLogger(__name__)

PROBE_ROWS = 2  # rows (entries of a vector) read back per parameter: enough to see a stale one, cheap to send
MAX_PROBES = 64  # parameters read back per engine at most (an MoE layer has hundreds: a spread of them is read)
NOT_READABLE = "Get parameter by name failed"  # SGLang's answer when its model class cannot read the name
_LAYER = re.compile(r"\.layers\.(\d+)\.")


class WeightVerifyError(Exception):
    """An engine serves other weights than the actor sent (see module contract)."""


@dataclass(frozen=True)
class VerifyResult:
    checked: int
    """(engine, parameter) pairs read back and found equal"""
    unsupported: bool
    """no engine could read any parameter by name (nothing was checked)"""


class SentRows:
    """The first rows of every tensor the sync sent, by name (float32 copies on the CPU)."""

    def __init__(self) -> None:
        self.rows: dict[str, torch.Tensor] = {}

    def capture(self, buckets: Iterable[Any]) -> Iterator[Any]:
        for bucket in buckets:
            for name, t in bucket:
                self.rows[name] = t[:PROBE_ROWS].detach().to("cpu", torch.float32, copy=True)
            yield bucket


def probe_names(names: Iterable[str]) -> list[str]:
    """The parameters to read back (see module contract), in a stable order."""
    names = list(names)
    layers = {n: int(m.group(1)) for n in names if (m := _LAYER.search(n))}
    ends = {min(layers.values()), max(layers.values())} if layers else set()
    picked = [n for n in names if n not in layers or layers[n] in ends]
    if len(picked) > MAX_PROBES:
        step = len(picked) / MAX_PROBES
        picked = [picked[int(i * step)] for i in range(MAX_PROBES)]
    return picked


def same_values(sent: torch.Tensor, served: Any) -> bool:
    """True when ``served`` (an engine's JSON list) equals ``sent``, exactly or after rounding ``sent`` to bfloat16 or
    float16 (the engine's own dtype)."""
    try:
        got = torch.tensor(served, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        return False
    if got.shape != sent.shape:
        return False
    return any(torch.equal(got, sent.to(dt).to(torch.float32)) for dt in (torch.float32, torch.bfloat16, torch.float16))


def _read(url: str, name: str, timeout_s: float) -> Optional[Any]:
    """The engine's first rows of ``name``; None when it cannot read it (SGLang's 400 ``NOT_READABLE``)."""
    try:
        return post_json(
            url,
            "/get_weights_by_name",
            {"name": name, "truncate_size": PROBE_ROWS},
            timeout_s=timeout_s,
            step="get_weights_by_name",
            check_success=False,
        )
    except EngineStepError as e:
        if e.status == 400 and NOT_READABLE in e.detail:
            return None
        raise


def _check_engine(url: str, sent: SentRows, names: list[str], timeout_s: float) -> int:
    """Read every probe from one engine; the number checked (0: it reads none). Raises on a difference."""
    served = {n: _read(url, n, timeout_s) for n in names}
    readable = [n for n, v in served.items() if v is not None]
    if not readable:
        return 0
    for n in names:
        if served[n] is None:
            raise WeightVerifyError(
                f"engine {url} has no parameter named {n!r}, which the sync sent: its loader dropped it (SGLang "
                "only warns on an unknown name), so it serves its own weights there; the actor's names do not match "
                "the engine's model"
            )
        if not same_values(sent.rows[n], served[n]):
            raise WeightVerifyError(
                f"engine {url} serves parameter {n!r} different from what the actor sent (first {PROBE_ROWS} rows "
                "compared): the update did not reach it (a name its loader does not map?)"
            )
    return len(names)


def verify_engines(urls: list[str], sent: SentRows, *, timeout_s: float) -> VerifyResult:
    """Read the probes back from every engine at once and compare (see module contract)."""
    names = probe_names(sent.rows)
    if not names:
        return VerifyResult(checked=0, unsupported=False)
    try:
        counts = fan_out(
            urls,
            lambda u: _check_engine(u, sent, names, timeout_s),
            timeout_s=timeout_s * (len(names) + 1),
            step="get_weights_by_name",
        )
    except EngineStepError as e:  # the fan-out wraps what a thread raised: a difference is not an engine failure
        if isinstance(e.__cause__, WeightVerifyError):
            raise e.__cause__ from None
        raise
    return VerifyResult(checked=sum(counts), unsupported=not any(counts))


_said_unsupported = False


def verify_sync(urls: list[str], sent: Optional[SentRows], *, version: Any, timeout_s: float) -> VerifyResult:
    """Step 8 of a sync (``weight_sync``): nothing when ``sent`` is None (not due), else ``verify_engines``, its
    error naming the version too, and once per process a warning when the engines cannot be checked."""
    global _said_unsupported
    if sent is None:
        return VerifyResult(checked=0, unsupported=False)
    try:
        res = verify_engines(urls, sent, timeout_s=timeout_s)
    except WeightVerifyError as e:
        raise WeightVerifyError(f"{e} (weight sync to version {version})") from None
    if res.unsupported and not _said_unsupported:
        _said_unsupported = True
        log.warning(
            "the engines cannot read parameters by name (/get_weights_by_name answers %r; SGLang 0.5.23 implements "
            "it for Llama-family models only): the served weights are not verified, only their version",
            NOT_READABLE,
        )
    return res
