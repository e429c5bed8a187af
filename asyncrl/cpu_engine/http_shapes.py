"""The CPU engine's HTTP side that needs no engine state: SGLang's answer shapes, the JSON body, and the
checks that turn a ``/generate`` body into requests.

    reqs, futs, batch = build_generate_requests(body, encode=tok_ids, vocab_size=V, context_length=C, loop=loop)
    # a bad body raises RequestError naming the field (the engine's middleware answers 400 with it)

Status codes and shapes as SGLang: a body its request struct refuses (none, bad JSON, not an object, a required field
missing, a field of the wrong type: ``read_body`` against ``BODY_MODELS``) is its validation 400
``{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}``; other bad generate requests
400 ``{"error": {"message"}}``; control calls answer ``{"success", "message"}`` with 200/400. Every field is type- and range-checked here (the message names it:
``sampling_params.top_p``, ``rid``, ``input_ids[3]``, ...), so no request can fail later on the engine thread.
Context length as SGLang: a prompt of ``context_length`` tokens or more, or an explicit ``max_new_tokens`` that
with the prompt reaches it, is rejected (400, the message names the lengths), never capped.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.message
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from aiohttp import web

from asyncrl.cpu_engine.request import Request, new_rid
from asyncrl.cpu_engine.sampling_params import MAX_TOKENS, RequestError, check_bool, check_int, parse_sampling_params
from asyncrl.engine.client import ENGINE_PAUSE_MODES

MAX_REQUESTS_PER_CALL = 1024  # prompts x n of one /generate call (each is a running request)
MAX_RID_CHARS = 512


def json_error(msg: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": msg}}, status=status)


def validation_error(msg: str) -> web.Response:
    """SGLang's answer to a body its request model refuses (FastAPI's validation error, turned into a 400 by its
    ``validation_exception_handler``); the message is ours (SGLang's is pydantic's text)."""
    return web.json_response(
        {"object": "error", "message": msg, "type": "Bad Request", "param": None, "code": 400}, status=400
    )


FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the "
    "operation will not be performed.)\n"
)
"""SGLang's ``/flush_cache`` text when the cache was flushed (200)."""
FLUSH_FAILED = "Flush cache failed.\n"
"""SGLang's ``/flush_cache`` text when the flush was refused (400)."""


def model_info_body(
    model_path: str,
    *,
    tokenizer_path: str,
    weight_version: str,
    load_format: str,
    model_type: str,
    architectures: Optional[list],
) -> dict:
    """SGLang's ``/model_info``, key for key (no parsers, no disaggregation: their defaults)."""
    return {
        "model_path": model_path,
        "served_model_name": model_path,
        "tokenizer_path": tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": weight_version,
        "load_format": load_format,
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": model_type,
        "architectures": architectures,
    }


def result(success: bool, message: str, **extra: Any) -> web.Response:
    return web.json_response({"success": success, "message": message, **extra}, status=200 if success else 400)


class InvalidBody(RequestError):
    """A body SGLang's request model refuses before its handler runs (no body, bad JSON, not an object, a required
    field missing, a field of the wrong type): answered with ``validation_error``."""


@dataclass(frozen=True)
class Field:
    """One field of an SGLang request struct (``managers/io_struct.py``): what its value must be, whether it is
    required. Checked strictly (pydantic would also take ``"5"`` for an int, ``"no"`` for a bool)."""

    ok: Callable[[Any], bool]
    expected: str
    required: bool = False


def _str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _int(v: Any) -> bool:
    return type(v) is int


STR = Field(lambda v: isinstance(v, str), "a string")
OPT_STR = Field(lambda v: v is None or isinstance(v, str), "a string or null")
INT = Field(_int, "an integer")
BOOL = Field(lambda v: type(v) is bool, "a boolean")
OPT_DICT = Field(lambda v: v is None or isinstance(v, dict), "an object or null")


def required(f: Field) -> Field:
    return Field(f.ok, f.expected, required=True)


def one_of(*values: str) -> Field:
    return Field(lambda v: v in values, "one of " + ", ".join(repr(x) for x in values))


SELECTORS = ("target", "draft", "all")
"""SGLang's runner selectors of a weight call; with no draft model (the CPU engine has none) each acts as ``all``."""
BASE_REQ = {"rid": OPT_STR, "http_worker_ipc": OPT_STR}
"""The fields every SGLang request struct has (``BaseReq``)."""
BODY_MODELS: dict[str, dict[str, Field]] = {
    "/abort_request": {**BASE_REQ, "abort_all": BOOL, "abort_message": OPT_STR},
    "/pause_generation": {**BASE_REQ, "mode": one_of(*ENGINE_PAUSE_MODES)},
    "/continue_generation": {**BASE_REQ, "torch_empty_cache": BOOL},
    "/begin_weight_update": {**BASE_REQ, "selector": one_of(*SELECTORS)},
    "/end_weight_update": BASE_REQ,
    "/init_weights_update_group": {
        **BASE_REQ,
        "master_address": required(STR),
        "master_port": required(INT),
        "rank_offset": required(INT),
        "world_size": required(INT),
        "group_name": STR,
        "backend": STR,
    },
    "/destroy_weights_update_group": {**BASE_REQ, "group_name": STR},
    "/update_weights_from_distributed": {
        **BASE_REQ,
        "names": required(Field(_str_list, "a list of strings")),
        "dtypes": required(Field(_str_list, "a list of strings")),
        "shapes": required(
            Field(
                lambda v: isinstance(v, list) and all(isinstance(x, list) and all(map(_int, x)) for x in v),
                "a list of lists of integers",
            )
        ),
        "group_name": STR,
        "flush_cache": BOOL,
        "abort_all_requests": BOOL,
        "weight_version": OPT_STR,
        "load_format": OPT_STR,
        "selector": one_of(*SELECTORS),
        "torch_empty_cache": BOOL,
    },
    "/update_weights_from_disk": {
        **BASE_REQ,
        "model_path": required(STR),
        "load_format": OPT_STR,
        "abort_all_requests": BOOL,
        "weight_version": OPT_STR,
        "is_async": BOOL,
        "torch_empty_cache": BOOL,
        "keep_pause": BOOL,
        "recapture_cuda_graph": BOOL,
        "token_step": INT,
        "flush_cache": BOOL,
        "manifest": OPT_DICT,
    },
    "/update_weights_from_tensor": {
        **BASE_REQ,
        "serialized_named_tensors": required(Field(_str_list, "a list of base64 strings")),
        "load_format": OPT_STR,
        "flush_cache": BOOL,
        "abort_all_requests": BOOL,
        "weight_version": OPT_STR,
        "selector": one_of(*SELECTORS),
        "torch_empty_cache": BOOL,
    },
    "/update_weight_version": {**BASE_REQ, "new_version": required(STR), "abort_all_requests": BOOL},
    "/get_weights_by_name": {**BASE_REQ, "name": required(STR), "truncate_size": INT},
}
"""Path -> its SGLang 0.5.23 request struct's fields (unknown keys are ignored there, and here)."""


def check_body(body: dict, model: dict[str, Field]) -> None:
    """``InvalidBody`` naming every field missing or of the wrong type (as pydantic lists every error)."""
    errors = []
    for key, f in model.items():
        if key not in body:
            if f.required:
                errors.append(f"body.{key}: field required")
        elif not f.ok(body[key]):
            errors.append(f"body.{key}: expected {f.expected}, got {body[key]!r:.80}")
    if errors:
        raise InvalidBody(f"{len(errors)} validation error(s): " + "; ".join(errors))


def _json_media_type(content_type: str) -> bool:
    """Whether FastAPI parses a body of this ``Content-Type`` as JSON: ``application/json`` or
    ``application/*+json`` (parameters and case aside; a malformed value counts as ``text/plain``)."""
    m = email.message.Message()
    m["content-type"] = content_type
    sub = m.get_content_subtype()
    return m.get_content_maintype() == "application" and (sub == "json" or sub.endswith("+json"))


async def read_body(request: web.Request) -> dict:
    """The JSON object of the request, checked against its route's ``BODY_MODELS`` entry when it has one. Every
    route that takes a body requires one, as SGLang's (``{}`` for the defaults), sent as JSON (no
    ``Content-Type``, or a JSON one)."""
    raw = await request.read()
    if not raw:
        raise InvalidBody("body: field required (send {} for the defaults)")
    content_type = request.headers.get("Content-Type")
    if content_type and not _json_media_type(content_type):  # FastAPI reads the body as JSON only then
        raise InvalidBody(f"body: expected a JSON body, got Content-Type {content_type!r:.80}")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, nesting too deep
        raise InvalidBody(f"body: JSON decode error: {e}") from None
    if not isinstance(data, dict):
        raise InvalidBody(f"body: expected a JSON object, got {type(data).__name__}")
    model = BODY_MODELS.get(request.path)
    if model is not None:
        check_body(data, model)
    return data


def weight_version_field(v: Any, key: str) -> Optional[str]:
    """A weight version as SGLang's struct takes it: a string, or None (an int is refused, as pydantic refuses it)."""
    if v is None or isinstance(v, str):
        return v
    raise RequestError(f"{key} must be a string, got {v!r:.80}")


def setter(fut: asyncio.Future) -> Callable[[dict], None]:
    """A request's ``deliver`` on the event loop: sets its future (unless its handler already gave up on it)."""

    def deliver(out: dict) -> None:
        if not fut.done():
            fut.set_result(out)

    return deliver


def parse_prompts(body: dict, *, encode: Callable[[str], list[int]], vocab_size: int) -> tuple[list[list[int]], bool]:
    """The request's prompts as token-id lists (``input_ids``, or ``text`` tokenized), and whether it is a
    batch. Every id must be an int inside the vocabulary."""
    ids, text = body.get("input_ids"), body.get("text")
    if ids is None and text is not None:
        if isinstance(text, str):
            ids = encode(text)
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            ids = [encode(t) for t in text]
        else:
            raise RequestError("text must be a string or a non-empty list of strings")
    if ids is None:
        raise RequestError("input_ids (or text) is required")
    if not isinstance(ids, list) or not ids:
        raise RequestError("input_ids must be a non-empty list of token ids (or a list of such lists)")
    batch = isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    if len(prompts) > MAX_REQUESTS_PER_CALL:
        raise RequestError(f"input_ids: {len(prompts)} prompts in one request, at most {MAX_REQUESTS_PER_CALL}")
    for i, prompt in enumerate(prompts):
        where = f"input_ids[{i}]" if batch else "input_ids"
        if not isinstance(prompt, list) or not prompt or not all(type(t) is int for t in prompt):
            raise RequestError(f"{where} must be a non-empty list of integer token ids")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return prompts, batch


def check_context(n_prompt: int, max_new: int, *, asked: bool, context_length: int) -> None:
    """As SGLang: a prompt that fills the context, or an explicit max_new_tokens that with the prompt reaches
    it, is a 400 naming the lengths (never a silently shorter output)."""
    ctx = context_length
    if n_prompt >= ctx:
        raise RequestError(f"the prompt has {n_prompt} tokens; the model's context length is {ctx} tokens")
    if asked and n_prompt + max_new >= ctx:
        raise RequestError(
            f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new}) = {n_prompt + max_new} tokens reaches the "
            f"model's context length ({ctx} tokens); shorten the prompt or lower max_new_tokens"
        )


def _rids(body: dict, *, batch: bool, n_prompts: int) -> list[Optional[str]]:
    """One rid (or None: a fresh one) per prompt."""
    rids = body.get("rid")
    if batch and rids is not None and (not isinstance(rids, list) or len(rids) != n_prompts):
        raise RequestError("rid: a batch needs a list of rids, one per prompt")
    rid_list = (rids if rids is not None else [None] * n_prompts) if batch else [rids]
    for r in rid_list:
        if r is not None and (not isinstance(r, str) or not 0 < len(r) <= MAX_RID_CHARS):
            raise RequestError(f"rid must be a non-empty string of at most {MAX_RID_CHARS} characters, got {r!r:.80}")
    return rid_list


def _per_prompt(body: dict, key: str, default: Any, *, batch: bool, n_prompts: int) -> list[Any]:
    """A field given once for every prompt, or (in a batch) as a list with one value per prompt."""
    v = body.get(key, default)
    if batch and isinstance(v, list) and key != "stop":
        if len(v) != n_prompts:
            raise RequestError(f"{key}: {len(v)} values for {n_prompts} prompts")
        return v
    return [v] * n_prompts


def _routed_experts_start(body: dict, n_prompt: int) -> Optional[int]:
    """SGLang's ``return_routed_experts`` (one bool for the whole call) and ``routed_experts_start_len`` (one int, at
    most the prompt's length): the first position whose routing the answer carries, or None when not asked. SGLang's
    texts for a start outside ``[0, n_prompt]`` (its scheduler finishes the request with that error: a 400)."""
    start = check_int(body.get("routed_experts_start_len", 0), "routed_experts_start_len", lo=-(2**63), hi=2**63 - 1)
    if not check_bool(body.get("return_routed_experts", False), "return_routed_experts"):
        return None
    if start < 0:
        raise RequestError(
            f"recv_req.routed_experts_start_len={start} is lower than 0. "
            "Please use a non-negative routed_experts_start_len."
        )
    if start > n_prompt:
        raise RequestError(
            f"recv_req.routed_experts_start_len={start} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={n_prompt}. Please use a smaller routed_experts_start_len."
        )
    return start


def build_generate_requests(
    body: dict,
    *,
    encode: Callable[[str], list[int]],
    vocab_size: int,
    context_length: int,
    loop: asyncio.AbstractEventLoop,
) -> tuple[list[Request], list[asyncio.Future], bool]:
    """``/generate``'s body -> requests (one per prompt and sample), their futures, and whether it is a batch.
    Every field is checked here (type, range), so a bad body is a 400 naming the field and nothing reaches
    the engine thread."""
    if "stream" in body and check_bool(body["stream"], "stream"):
        raise RequestError("stream=true is not supported by the CPU engine")
    prompts, batch = parse_prompts(body, encode=encode, vocab_size=vocab_size)
    n = len(prompts)
    rid_list = _rids(body, batch=batch, n_prompts=n)
    raw_params = _per_prompt(body, "sampling_params", {}, batch=batch, n_prompts=n)
    params_list = [parse_sampling_params(p) for p in raw_params]
    if sum(p.n for p in params_list) > MAX_REQUESTS_PER_CALL:
        raise RequestError(
            f"sampling_params.n: {sum(p.n for p in params_list)} samples in one request, "
            f"at most {MAX_REQUESTS_PER_CALL}"
        )
    rlp = [
        check_bool(v, "return_logprob") for v in _per_prompt(body, "return_logprob", False, batch=batch, n_prompts=n)
    ]
    lsl = [
        -1 if v is None else check_int(v, "logprob_start_len", lo=-1, hi=MAX_TOKENS)
        for v in _per_prompt(body, "logprob_start_len", -1, batch=batch, n_prompts=n)
    ]
    routed_from = [_routed_experts_start(body, len(prompt)) for prompt in prompts]
    reqs, futs = [], []
    for i, prompt in enumerate(prompts):
        p = params_list[i]
        asked = isinstance(raw_params[i], dict) and raw_params[i].get("max_new_tokens") is not None
        check_context(len(prompt), p.max_new_tokens, asked=asked, context_length=context_length)
        for k in range(p.n):
            base = rid_list[i] if rid_list[i] is not None else new_rid()
            fut = loop.create_future()
            rid = base if p.n == 1 else f"{base}_{k}"
            deliver = setter(fut)
            reqs.append(
                Request(
                    rid=rid,
                    input_ids=list(prompt),
                    params=p,
                    return_logprob=rlp[i],
                    logprob_start_len=lsl[i],
                    routed_experts_start=routed_from[i],
                    deliver=deliver,
                )
            )
            futs.append(fut)
    return reqs, futs, batch


class ModelUpdateLock:
    """SGLang's ``model_update_lock`` (a readers-writer lock in its HTTP process): every ``/generate`` holds a read
    side from its tokenization to its answer; a weight call made while the engine is not paused takes the write
    side, so it waits for the in-flight generations and new ones wait for it."""

    def __init__(self) -> None:
        self._readers = 0
        self._writing = False
        self._cond = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def reading(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def writing(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing and self._readers == 0)
            self._writing = True
        try:
            yield
        finally:
            async with self._cond:
                self._writing = False
                self._cond.notify_all()
