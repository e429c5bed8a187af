"""SGLang's ``sampling_params`` and the checks of every request field, before anything reaches the engine thread.

    p = parse_sampling_params({"max_new_tokens": 16, "temperature": 0.7, "stop": ["</answer>"]})
    p.greedy, p.stop  # -> False, ("</answer>",)
    parse_sampling_params({"top_p": 0})  # RequestError: sampling_params.top_p must be in (0, 1], got 0

Pure (no I/O): a bad value is a ``RequestError`` (HTTP 400) whose message names the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

# Request bounds (a 400 beyond them, before anything reaches the engine thread):
MAX_TOKENS = 1 << 30  # max_new_tokens / min_new_tokens; generation stops at the context length anyway
MAX_TEMPERATURE = 1e6  # far past where sampling is uniform; larger values are typos or overflow probes
MAX_TOP_K = 1 << 30  # SGLang's own stand-in for "no top-k"; a larger k is clamped (same meaning)
MAX_N = 64  # parallel samples of one prompt in one request (each is a running request)


class RequestError(ValueError):
    """A request the engine rejects (HTTP 400); the message names the field at fault."""


# Every key SGLang's SamplingParams accepts (0.5.x). Unknown keys are a 400, as in SGLang.
_SGLANG_SAMPLING_KEYS = {
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "custom_params",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
}
# Known to SGLang but not implemented here: accepted only at their neutral value.
_NEUTRAL = {
    "stop_regex": (None, [], ""),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "logit_bias": (None, {}),
    "custom_params": (None, {}),
}


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    min_new_tokens: int = 0
    n: int = 1
    sampling_seed: Optional[int] = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1


def _is_int(v: Any) -> bool:
    return type(v) is int  # a JSON integer; never a bool or a float such as 1.0 or 1e400 (= inf)


def check_int(v: Any, key: str, *, lo: int, hi: int) -> int:
    """``v`` as an integer in ``[lo, hi]``; ``RequestError`` naming ``key`` otherwise."""
    if not _is_int(v) or not lo <= v <= hi:
        raise RequestError(f"{key} must be an integer in [{lo}, {hi}], got {v!r:.80}")
    return v


def check_number(v: Any, key: str, *, lo: float, hi: float) -> float:
    """``v`` as a finite number in ``[lo, hi]`` (NaN and inf fail; so do bools and strings)."""
    if type(v) not in (int, float) or not lo <= v <= hi:
        raise RequestError(f"{key} must be a finite number in [{lo:g}, {hi:g}], got {v!r:.80}")
    return float(v)


def check_bool(v: Any, key: str) -> bool:
    """A JSON ``true``/``false``: the string ``"false"`` is an error, not ``True``."""
    if type(v) is not bool:
        raise RequestError(f"{key} must be true or false, got {v!r:.80}")
    return v


def parse_sampling_params(raw: Any) -> SamplingParams:
    """SGLang's ``sampling_params`` dict -> ``SamplingParams``; ``RequestError`` names the bad key.
    Every value is type- and range-checked here, so nothing a client sends can fail later on the engine
    thread (``top_k`` above the vocabulary means no top-k cut, as in SGLang, and is clamped)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError(f"sampling_params must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _SGLANG_SAMPLING_KEYS, key=str)
    if unknown:
        raise RequestError(f"sampling_params: unexpected keyword argument(s) {unknown}")
    for key, neutral in _NEUTRAL.items():
        if key in raw and not any(type(raw[key]) is type(x) and raw[key] == x for x in neutral):
            raise RequestError(f"sampling_params.{key}={raw[key]!r:.80} is not supported by the CPU engine")
    kw: dict[str, Any] = {}
    get = {k: v for k, v in raw.items() if v is not None}.get
    sp = "sampling_params."
    if get("max_new_tokens") is not None:
        kw["max_new_tokens"] = check_int(get("max_new_tokens"), sp + "max_new_tokens", lo=0, hi=MAX_TOKENS)
    if get("temperature") is not None:
        kw["temperature"] = check_number(get("temperature"), sp + "temperature", lo=0.0, hi=MAX_TEMPERATURE)
    if get("top_p") is not None:
        kw["top_p"] = check_number(get("top_p"), sp + "top_p", lo=0.0, hi=1.0)
        if kw["top_p"] == 0.0:
            raise RequestError("sampling_params.top_p must be in (0, 1], got 0")
    if get("min_p") is not None:
        kw["min_p"] = check_number(get("min_p"), sp + "min_p", lo=0.0, hi=1.0)
    if get("top_k") is not None:
        k = get("top_k")
        if not _is_int(k) or not (k == -1 or k >= 1):
            raise RequestError(f"sampling_params.top_k must be -1 or an integer >= 1, got {k!r:.80}")
        kw["top_k"] = min(k, MAX_TOP_K)  # any k >= the vocabulary keeps every token
    if get("min_new_tokens") is not None:
        kw["min_new_tokens"] = check_int(get("min_new_tokens"), sp + "min_new_tokens", lo=0, hi=MAX_TOKENS)
    if get("n") is not None:
        kw["n"] = check_int(get("n"), sp + "n", lo=1, hi=MAX_N)
    if get("sampling_seed") is not None:
        kw["sampling_seed"] = check_int(get("sampling_seed"), sp + "sampling_seed", lo=0, hi=2**64 - 1)
    stop = get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
            raise RequestError(f"sampling_params.stop must be a non-empty string or a list of them, got {stop!r:.80}")
        kw["stop"] = tuple(stops)
    ids = get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t < 2**63 for t in ids):
            raise RequestError(f"sampling_params.stop_token_ids must be a list of token ids, got {ids!r:.80}")
        kw["stop_token_ids"] = tuple(ids)
    for k in ("ignore_eos", "skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens"):
        if get(k) is not None:
            v = check_bool(get(k), sp + k)
            if k != "spaces_between_special_tokens":
                kw[k] = v
    if get("stream_interval") is not None:
        check_int(get("stream_interval"), sp + "stream_interval", lo=1, hi=MAX_TOKENS)
    return SamplingParams(**kw)
