"""One generation request on the CPU engine: its state while it runs, and its answer as SGLang's ``/generate`` JSON.

    r = Request(rid="a", input_ids=[1, 2, 3], params=parse_sampling_params({}), deliver=print)
    r.feed()  # -> [1, 2, 3]: the tokens its KV does not hold yet (kv_len == 0)
    response(r, decode=lambda ids, skip: "", weight_version="0")["meta_info"]["finish_reason"]  # abort

Pure (no I/O).
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from asyncrl.cpu_engine.sampling_params import SamplingParams

ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
"""The finish reason of a running request that was aborted, as SGLang 0.5.23 writes it (its ``FINISH_ABORT``)."""


@dataclass(eq=False)
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    deliver: Callable[[dict], None]
    return_logprob: bool = False
    logprob_start_len: int = -1
    routed_experts_start: Optional[int] = None
    """SGLang's ``return_routed_experts`` with its ``routed_experts_start_len``: the request asked for the experts
    its tokens were routed to from this position on (None: it did not ask)."""
    routed_experts: Optional[torch.Tensor] = None
    """The routing of positions ``routed_experts_start .. len(tokens()) - 2`` [positions, layers, top-k] int32, taken
    when it finished (on an engine started with ``--enable-return-routed-experts``; else None)."""
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: Optional[list[Optional[float]]] = None
    weight_versions: list[dict] = field(default_factory=list)
    num_retractions: int = 0
    retracted: bool = False
    cached_tokens: int = 0
    kv_len: int = 0
    row: int = -1
    created_s: float = field(default_factory=time.monotonic)
    generator: Optional[torch.Generator] = None
    finish_reason: Optional[dict] = None
    stop_text: Optional[str] = None

    def tokens(self) -> list[int]:
        return self.input_ids + self.output_ids

    def feed(self) -> list[int]:
        """``tokens()[kv_len:]`` without building the whole list (decode: the last token)."""
        n_in = len(self.input_ids)
        if self.kv_len >= n_in:
            return self.output_ids[self.kv_len - n_in :]
        return self.input_ids[self.kv_len :] + self.output_ids


def response(r: Request, *, decode: Callable[[list[int], bool], str], weight_version: str) -> dict:
    """A finished (or aborted) request as SGLang's ``/generate`` JSON: text (stop-trimmed as SGLang), output ids
    (untrimmed), ``meta_info``; ``weight_version`` is the engine's now."""
    p = r.params
    reason = r.finish_reason or dict(ABORTED)
    ids = r.output_ids
    if not p.no_stop_trim and reason["type"] == "stop" and isinstance(reason.get("matched"), int):
        text = decode(ids[:-1], p.skip_special_tokens)
    else:
        text = decode(ids, p.skip_special_tokens)
        if not p.no_stop_trim and r.stop_text is not None and r.stop_text in text:
            text = text[: text.index(r.stop_text)]
    meta: dict[str, Any] = {
        "id": r.rid,
        "finish_reason": reason,
        "prompt_tokens": len(r.input_ids),
        "completion_tokens": len(ids),
        "cached_tokens": r.cached_tokens,
        "num_retractions": r.num_retractions,
        "reasoning_tokens": 0,  # SGLang counts think-block tokens only for a reasoning request or model
        "e2e_latency": time.monotonic() - r.created_s,
        "weight_version": weight_version,
        "weight_versions": [dict(w) for w in r.weight_versions],
    }
    if r.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.output_logprobs, ids)]
        start = r.logprob_start_len
        meta["input_token_logprobs"] = (
            [[lp, t, None] for lp, t in zip(r.input_logprobs or [], r.input_ids[start:])] if start >= 0 else []
        )
    if r.routed_experts is not None:
        meta["routed_experts"] = encode_routed_experts(r.routed_experts)
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


def encode_routed_experts(routed: torch.Tensor) -> str:
    """SGLang's ``meta_info["routed_experts"]``: the int32 array's bytes (C order, the host's little-endian) in
    base64 (its ``detokenizer_manager._b64_encode_per_request``); read back with
    ``np.frombuffer(base64.b64decode(s), np.int32).reshape(-1, num_hidden_layers, num_experts_per_tok)``."""
    return base64.b64encode(routed.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


# ---- control (engine thread, through ``call``) -------------------------------------


def new_rid() -> str:
    return uuid.uuid4().hex
