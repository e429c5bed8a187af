"""The CPU engine: an HTTP server that speaks SGLang's API (the subset an RL trainer uses).

    python -m asyncrl.rollout.cpu_engine --model-path DIR --port P [--host H]
        [--max-running-requests N] [--weight-version V] [--seed S] [--nccl-port P] [--dist-timeout S]

Contract (see shared/notes/sglang-http-protocol.md; the same client and trainer code drive SGLang)
- Threads: the aiohttp event loop answers HTTP; one engine thread runs ``Scheduler.run`` (model
  steps, continuous batching). Handlers never touch scheduler state directly: requests go through
  ``Scheduler.submit`` and every control action through ``Scheduler.call`` (runs between two model
  steps). ``/init_weights_update_group`` blocks a worker thread (not the scheduler) until the
  trainer joins.
- Weight updates: ``/update_weights_from_distributed`` fails (400) unless ``/begin_weight_update``
  was called and not yet ended; tensors are received by ``broadcast`` from group rank 0 in the
  order of ``names`` (``load_format="flattened_bucket"``: ONE uint8 broadcast holding each
  tensor's raw bytes back to back, in that order, as SGLang's FlattenedTensorBucket), on the engine
  thread, so a weight load never overlaps a forward. ``/update_weights_from_disk`` reads a HF
  safetensors directory on a worker thread and copies it in on the engine thread the same way.
- Context length as SGLang: a prompt of ``context_length`` tokens or more, or an explicit ``max_new_tokens``
  that with the prompt reaches it, is rejected (400, the message names the lengths), never capped.
- Status codes as SGLang: 400 with ``{"error": {"message"}}`` for bad generate requests; control
  calls answer ``{"success", "message"}`` with 200/400; ``/flush_cache`` answers text, 400 while
  requests are running. Every field is type- and range-checked in the handler (the message names it:
  ``sampling_params.top_p``, ``abort_all``, ``shapes``, ...), so no request can fail later on the engine thread.
- Weight updates are atomic: names, dtypes and shapes are checked against the running model before the
  collective (a mismatch is a 400, never a gloo size mismatch), tensors are received off the running
  weights (into a standby bank of the same shapes, made on the first update and kept) and put in only
  when all arrived: a weight buffer that arrived whole is swapped with the bank's (no copy), the rest copied.
- A ``/generate`` whose HTTP client disconnects (timeout, killed) has its requests aborted, as SGLang does; they
  count in ``sglang:num_aborted_requests_total`` (as SGLang) and in ``sglang:num_disconnect_aborted_requests_total``
  on ``/metrics`` (ours: SGLang has no separate series).
- A crash of the engine thread exits the process with status 1 (the launcher restarts it).
- Start-up as SGLang's (0.5.23 ``srt/distributed/bootstrap.py``): before loading the model the engine
  creates its own one-process torch.distributed world, ``init_process_group("gloo",
  init_method="tcp://<host>:<nccl_port>", rank=0, world_size=1)`` (SGLang does this even at TP=1, with
  a free ``nccl_port`` unless ``--nccl-port``). So an engine started with a torchrun rank's environment
  (``TORCHELASTIC_USE_AGENT_STORE=True``) fails here exactly as SGLang would (it waits for a store nobody
  hosts, then exits after ``--dist-timeout``): CI sees a launcher that leaks that environment.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from aiohttp import web
from tokenizers import Tokenizer

from asyncrl.cluster import auth
from asyncrl.cluster.auth import bearer_matches, open_path
from asyncrl.rollout.cpu_model import CausalLM, iter_safetensors, load_model
from asyncrl.rollout.cpu_scheduler import (
    MAX_TOKENS,
    PAUSE_MODES,
    Request,
    RequestError,
    Scheduler,
    check_bool,
    check_int,
    new_rid,
    parse_sampling_params,
)
from asyncrl.sync.process_group import destroy_weight_update_group, init_weight_update_group

log = logging.getLogger("asyncrl.cpu_engine")

ENGINE_VERSION = "asyncrl-cpu-engine-0.1"
HEALTH_CHECK_TIMEOUT_S = 20.0  # as SGLang's default SGLANG_HEALTH_CHECK_TIMEOUT
DISCONNECT_POLL_S = 0.2  # how often a waiting /generate checks that its client is still connected
MAX_REQUESTS_PER_CALL = 1024  # prompts x n of one /generate call (each is a running request)
MAX_RID_CHARS = 512
MAX_TENSORS_PER_UPDATE = 100_000  # names in one /update_weights_from_distributed call


@dataclass(frozen=True)
class EngineArgs:
    model_path: str
    port: int
    host: str = "127.0.0.1"
    max_running_requests: int = 64
    weight_version: str = "default"
    seed: int = 0
    prefix_cache_tokens: int = 32768
    """Tokens of finished requests' KV kept for prefix reuse (0 disables)."""
    context_length: Optional[int] = None
    """Defaults to the model's max_position_embeddings."""
    num_threads: Optional[int] = None
    """torch intra-op threads (default: torch's choice)."""
    weight_sync_timeout_s: float = 600.0
    """Timeout of the weight-update group (join and each broadcast)."""
    nccl_port: Optional[int] = None
    """Port of the engine's own one-process torch.distributed world (SGLang ``--nccl-port``; default: free)."""
    dist_timeout_s: float = 120.0
    """Timeout of creating that world (SGLang ``--dist-timeout``)."""
    api_key: Optional[str] = None
    """SGLang's ``--api-key``: every request but OPTIONS and paths starting with ``/health``, ``/ready`` or
    ``/metrics`` needs ``Authorization: Bearer <key>`` (else 401 ``{"error": "Unauthorized"}``); defaults to
    ``ASYNCRL_API_KEY``. Matches sglang 0.5.23 exactly (``asyncrl.cluster.auth`` says which files)."""


def _json_error(msg: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": msg}}, status=status)


def _result(success: bool, message: str, **extra: Any) -> web.Response:
    return web.json_response({"success": success, "message": message, **extra}, status=200 if success else 400)


async def _body(request: web.Request, *, required: bool = True) -> dict:
    raw = await request.read()
    if not raw:
        if required:
            raise RequestError("a JSON body is required (send {} for the defaults)")
        return {}
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, nesting too deep
        raise RequestError(f"invalid JSON body: {e}") from None
    if not isinstance(data, dict):
        raise RequestError("the JSON body must be an object")
    return data


def _weight_version(v: Any, key: str) -> Optional[str]:
    """A weight version as SGLang keeps it: a string (an int is accepted and stringified), or None."""
    if v is None or isinstance(v, str):
        return v
    if type(v) is int:
        return str(v)
    raise RequestError(f"{key} must be a string, got {v!r:.80}")


def _torch_dtype(name: Any) -> torch.dtype:
    if not isinstance(name, str):
        raise RequestError(f"dtypes: a dtype is a string such as 'bfloat16', got {name!r:.80}")
    n = name.removeprefix("torch.")
    dt = getattr(torch, n, None)
    if not isinstance(dt, torch.dtype):
        raise RequestError(f"unknown dtype {name!r}")
    return dt


class CpuEngine:
    def __init__(self, args: EngineArgs):
        self.args = args
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        t0 = time.monotonic()
        self.model = load_model(args.model_path)
        tok_path = Path(args.model_path) / "tokenizer.json"
        if not tok_path.is_file():
            raise FileNotFoundError(f"model path {args.model_path!r}: no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(tok_path))
        self.scheduler = Scheduler(
            self.model,
            self._decode,
            max_running_requests=args.max_running_requests,
            seed=args.seed,
            weight_version=args.weight_version,
            prefix_cache_tokens=args.prefix_cache_tokens,
            context_length=args.context_length,
        )
        self.groups: dict[str, Any] = {}
        self.update_open = False
        self._standby: Optional[CausalLM] = None
        """Weight-update standby bank (``_receive``): a second copy of the weights, made on first use."""
        self._flat_staging: Optional[torch.Tensor] = None
        """Reused receive buffer of the flattened format (grown to the largest bucket)."""
        self.num_disconnect_aborts = 0
        """Requests aborted because their HTTP client disconnected before the answer."""
        self.unauthorized = 0
        """Requests refused for a missing or wrong API key."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-engine", daemon=True)
        log.info(
            "loaded %s (%s, %d layers) in %.1fs",
            args.model_path,
            self.model.spec.model_type,
            self.model.spec.num_layers,
            time.monotonic() - t0,
        )

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def _run(self) -> None:
        try:
            self.scheduler.run(self._stop)
        except BaseException:
            log.error("engine thread crashed:\n%s", traceback.format_exc())
            sys.stderr.flush()
            os._exit(1)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    async def _call(self, fn):
        return await asyncio.wrap_future(self.scheduler.call(fn))

    # ---- app -----------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._auth, self._errors])
        r = app.router
        for path in ("/generate",):
            r.add_post(path, self.generate)
            r.add_put(path, self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/begin_weight_update", self.begin_weight_update)
        r.add_post("/end_weight_update", self.end_weight_update)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_route("*", "/flush_cache", self.flush_cache)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/weight_version", "/get_weight_version"):
            r.add_get(path, self.weight_version)
        r.add_get("/metrics", self.metrics)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_cleanup(self, app: web.Application) -> None:
        self.stop()

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        """SGLang's ``--api-key`` check (see ``EngineArgs.api_key``); refusals are counted, never fatal."""
        key = self.args.api_key
        if not key or open_path(request.method, request.path):
            return await handler(request)
        if not bearer_matches(request.headers.get("Authorization"), key):
            self.unauthorized += 1
            if self.unauthorized & (self.unauthorized - 1) == 0:
                log.warning(
                    "refused %s %s from %s without the API key (%d so far)",
                    request.method,
                    request.path,
                    request.remote,
                    self.unauthorized,
                )
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except RequestError as e:
            return _json_error(str(e))

    # ---- generation ----------------------------------------------------------------------
    def _prompts(self, body: dict) -> tuple[list[list[int]], bool]:
        """The request's prompts as token-id lists (``input_ids``, or ``text`` tokenized), and whether it is a
        batch. Every id must be an int inside the vocabulary."""
        ids, text = body.get("input_ids"), body.get("text")
        if ids is None and text is not None:
            if isinstance(text, str):
                ids = self.tokenizer.encode(text).ids
            elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
                ids = [self.tokenizer.encode(t).ids for t in text]
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
        vocab = self.model.spec.vocab_size
        for i, prompt in enumerate(prompts):
            where = f"input_ids[{i}]" if batch else "input_ids"
            if not isinstance(prompt, list) or not prompt or not all(type(t) is int for t in prompt):
                raise RequestError(f"{where} must be a non-empty list of integer token ids")
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return prompts, batch

    def _build_requests(self, body: dict, loop: asyncio.AbstractEventLoop) -> tuple[list[Request], list, bool]:
        """``/generate``'s body -> requests (one per prompt and sample) and their futures. Every field is checked
        here (type, range), so a bad body is a 400 naming the field and nothing reaches the engine thread."""
        if "stream" in body and check_bool(body["stream"], "stream"):
            raise RequestError("stream=true is not supported by the CPU engine")
        prompts, batch = self._prompts(body)
        n_prompts = len(prompts)

        def per(key: str, default: Any) -> list[Any]:
            v = body.get(key, default)
            if batch and isinstance(v, list) and key not in ("stop",):
                if len(v) != n_prompts:
                    raise RequestError(f"{key}: {len(v)} values for {n_prompts} prompts")
                return v
            return [v] * n_prompts

        rids = body.get("rid")
        if batch and rids is not None and (not isinstance(rids, list) or len(rids) != n_prompts):
            raise RequestError("rid: a batch needs a list of rids, one per prompt")
        rid_list = (rids if rids is not None else [None] * n_prompts) if batch else [rids]
        for r in rid_list:
            if r is not None and (not isinstance(r, str) or not 0 < len(r) <= MAX_RID_CHARS):
                raise RequestError(
                    f"rid must be a non-empty string of at most {MAX_RID_CHARS} characters, got {r!r:.80}"
                )
        raw_params = per("sampling_params", {})
        params_list = [parse_sampling_params(p) for p in raw_params]
        if sum(p.n for p in params_list) > MAX_REQUESTS_PER_CALL:
            raise RequestError(
                f"sampling_params.n: {sum(p.n for p in params_list)} samples in one request, "
                f"at most {MAX_REQUESTS_PER_CALL}"
            )
        rlp = [check_bool(v, "return_logprob") for v in per("return_logprob", False)]
        lsl = [
            -1 if v is None else check_int(v, "logprob_start_len", lo=-1, hi=MAX_TOKENS)
            for v in per("logprob_start_len", -1)
        ]
        reqs, futs = [], []
        for i, prompt in enumerate(prompts):
            p = params_list[i]
            self._check_context(
                len(prompt),
                p.max_new_tokens,
                asked=isinstance(raw_params[i], dict) and raw_params[i].get("max_new_tokens") is not None,
            )
            for k in range(p.n):
                base = rid_list[i] if rid_list[i] is not None else new_rid()
                fut = loop.create_future()
                reqs.append(
                    Request(
                        rid=base if p.n == 1 else f"{base}_{k}",
                        input_ids=list(prompt),
                        params=p,
                        return_logprob=rlp[i],
                        logprob_start_len=lsl[i],
                        deliver=self._deliverer(loop, fut),
                    )
                )
                futs.append(fut)
        return reqs, futs, batch

    async def generate(self, request: web.Request) -> web.Response:
        body = await _body(request)
        loop = asyncio.get_running_loop()
        reqs, futs, batch = self._build_requests(body, loop)
        submitted: list[Request] = []
        try:
            for req in reqs:
                self.scheduler.submit(req)
                submitted.append(req)
        except RequestError:
            self._abort(submitted)  # all or nothing
            raise
        outs = await self._wait_or_abort(request, submitted, futs)
        if outs is None:  # the client went away: its requests were aborted; nobody reads this answer
            return web.Response(status=499)
        if not batch and len(outs) == 1:
            return web.json_response(outs[0])
        return web.json_response(list(outs))

    def _abort(self, reqs: list[Request]) -> None:
        for req in reqs:
            self.scheduler.call(lambda s, rid=req.rid: s.abort(rid))

    async def _wait_or_abort(self, request: web.Request, reqs: list[Request], futs: list) -> Optional[list]:
        """Wait for every request's output. When the HTTP client disconnects (its timeout fired, it was killed)
        the requests are aborted at once -- as SGLang does on disconnect -- instead of generating for nobody."""
        gathered = asyncio.gather(*futs)
        try:
            while True:
                done, _ = await asyncio.wait({gathered}, timeout=DISCONNECT_POLL_S)
                if done:
                    return gathered.result()
                transport = request.transport
                if transport is None or transport.is_closing():
                    log.info(
                        "client of %d request(s) disconnected (rid %s...): aborting them",
                        len(reqs),
                        reqs[0].rid if reqs else "?",
                    )
                    self._abort(reqs)
                    self.num_disconnect_aborts += len(reqs)
                    return None
        except asyncio.CancelledError:  # the server cancelled the handler (shutdown): abort its requests
            self._abort(reqs)
            raise
        finally:
            if not gathered.done():
                gathered.cancel()

    def _check_context(self, n_prompt: int, max_new: int, *, asked: bool) -> None:
        """As SGLang: a prompt that fills the context, or an explicit max_new_tokens that with the prompt reaches
        it, is a 400 naming the lengths (never a silently shorter output)."""
        ctx = self.scheduler.context_length
        if n_prompt >= ctx:
            raise RequestError(f"the prompt has {n_prompt} tokens; the model's context length is {ctx} tokens")
        if asked and n_prompt + max_new >= ctx:
            raise RequestError(
                f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new}) = {n_prompt + max_new} tokens reaches the "
                f"model's context length ({ctx} tokens); shorten the prompt or lower max_new_tokens"
            )

    @staticmethod
    def _deliverer(loop: asyncio.AbstractEventLoop, fut: asyncio.Future):
        def deliver(out: dict) -> None:
            def _set() -> None:
                if not fut.done():
                    fut.set_result(out)

            loop.call_soon_threadsafe(_set)

        return deliver

    async def health(self, request: web.Request) -> web.Response:
        if self.scheduler.paused is not None:  # a paused scheduler runs no request: ask it a control call instead
            try:
                await asyncio.wait_for(self._call(lambda s: True), HEALTH_CHECK_TIMEOUT_S)
            except asyncio.TimeoutError:
                return web.Response(status=503)
            return web.Response(status=200)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        req = Request(
            rid=f"HEALTH_CHECK_{time.time()}",
            input_ids=[0],
            params=parse_sampling_params({"max_new_tokens": 1, "temperature": 0.0}),
            deliver=self._deliverer(loop, fut),
        )
        self.scheduler.submit(req)
        try:
            await asyncio.wait_for(fut, HEALTH_CHECK_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.scheduler.call(lambda s: s.abort(req.rid))
            return web.Response(status=503)
        return web.Response(status=200)

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _body(request)
        rid, abort_all = body.get("rid", ""), check_bool(body.get("abort_all", False), "abort_all")
        if not isinstance(rid, str):
            raise RequestError(f"rid must be a string, got {rid!r:.80}")
        await self._call(lambda s: s.abort(rid, abort_all=abort_all))
        return web.Response(status=200)

    # ---- pause / continue ----------------------------------------------------------------
    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await _body(request)
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode={mode!r} is not one of {list(PAUSE_MODES)}")
        await self._call(lambda s: s.pause(mode))
        log.info("paused (%s)", mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await _body(request, required=False)
        await self._call(lambda s: s.resume())
        log.info("continued")
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = await self._call(lambda s: s.flush_cache())
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. (When there are running or "
            "waiting requests, the operation will not be performed.)\n",
            status=200 if ok else 400,
        )

    # ---- weight updates ------------------------------------------------------------------
    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _body(request)
        try:
            addr, name, backend = (
                body.get("master_address"),
                body.get("group_name", "weight_update_group"),
                body.get("backend", "nccl"),
            )
            for key, v in (("master_address", addr), ("group_name", name), ("backend", backend)):
                if not isinstance(v, str) or not v:
                    raise RequestError(f"{key} must be a non-empty string, got {v!r:.80}")
            port = check_int(body.get("master_port"), "master_port", lo=1, hi=65535)
            world = check_int(body.get("world_size"), "world_size", lo=2, hi=1 << 20)
            rank = check_int(body.get("rank_offset"), "rank_offset", lo=1, hi=world - 1)  # the CPU engine: one rank
        except RequestError as e:
            return _result(False, f"init_weights_update_group: {e}")
        if backend != "gloo":
            return _result(False, f"backend={backend!r} is not available on the CPU engine; use 'gloo'")
        if name in self.groups:
            return _result(False, f"group {name!r} already exists; destroy it first")
        try:
            pg = await asyncio.to_thread(
                init_weight_update_group,
                addr,
                port,
                rank,
                world,
                name,
                backend=backend,
                timeout_s=self.args.weight_sync_timeout_s,
            )
        except (RuntimeError, ValueError) as e:
            log.error("init_weights_update_group failed: %s", e)
            return _result(False, f"Failed to initialize custom process group: {e}")
        self.groups[name] = pg
        log.info("joined weight-update group %s at %s:%d as rank %d/%d", name, addr, port, rank, world)
        return _result(True, "Succeeded to initialize custom process group.")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _body(request)
        name = body.get("group_name", "weight_update_group")
        if not isinstance(name, str):
            return _result(False, f"group_name must be a string, got {name!r:.80}")
        pg = self.groups.pop(name, None)
        if pg is None:
            return _result(False, f"group {name!r} does not exist")
        await self._call(lambda s: destroy_weight_update_group(pg))
        return _result(True, "Succeeded to destroy custom process group.")

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        body = await _body(request, required=False)
        selector = body.get("selector", "all")
        if selector != "all":
            return _result(False, f"selector={selector!r} is not supported (only 'all')")
        self.update_open = True
        return _result(True, "Weight update begun.")

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await _body(request, required=False)
        if not self.update_open:
            return _result(False, "no weight update in progress: call /begin_weight_update first")
        self.update_open = False
        return _result(True, "Weight update ended.")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await _body(request)
        name = body.get("group_name", "weight_update_group")
        if not isinstance(name, str):
            return _result(False, f"group_name must be a string, got {name!r:.80}")
        if not self.update_open:
            return _result(
                False, "weight update not begun: call /begin_weight_update before /update_weights_from_distributed"
            )
        pg = self.groups.get(name)
        if pg is None:
            return _result(False, f"group {name!r} does not exist: call /init_weights_update_group first")
        try:  # all of it before the collective: a bad bucket is a 400, never a broadcast of mismatched sizes
            names, dts, shapes = self._check_update(body)
            flush = check_bool(body.get("flush_cache", True), "flush_cache")
            version = _weight_version(body.get("weight_version"), "weight_version")
            abort_all = check_bool(body.get("abort_all_requests", False), "abort_all_requests")
            fmt = body.get("load_format")
            if fmt not in (None, "flattened_bucket"):
                raise RequestError(f"load_format={fmt!r:.80} is not supported (null or 'flattened_bucket')")
        except RequestError as e:
            return _result(False, str(e))
        if abort_all:
            await self._call(lambda s: s.abort(abort_all=True))
        fn = lambda s: self._receive(s, pg, names, dts, shapes, fmt, flush, version)  # noqa: E731
        ok, msg = await self._call(fn)
        return _result(ok, msg)

    def _check_update(self, body: dict) -> tuple[list[str], list[torch.dtype], list[tuple[int, ...]]]:
        """Validate an update's metadata against the running model BEFORE the collective: every name known
        (or one SGLang skips: a tied ``lm_head.weight``, ``rotary_emb.inv_freq``), no name twice, a float dtype,
        and the model's own shape. The broadcast sizes follow from these shapes, so a metadata mistake is a 400
        here instead of a size mismatch inside gloo (which aborts the process)."""
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (
            isinstance(names, list)
            and isinstance(dtypes, list)
            and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)
            and names
        ):
            raise RequestError("names, dtypes and shapes must be non-empty lists of the same length")
        if len(names) > MAX_TENSORS_PER_UPDATE:
            raise RequestError(f"names: {len(names)} tensors in one update, at most {MAX_TENSORS_PER_UPDATE}")
        if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            raise RequestError("names must be distinct strings")
        dts = [_torch_dtype(d) for d in dtypes]
        for n, d in zip(names, dts):
            if not d.is_floating_point:
                raise RequestError(f"dtypes: {n!r} has dtype {d}; weights are floating point")
        m = self.model
        out = []
        for n, shape in zip(names, shapes):
            if not isinstance(shape, list) or not all(type(x) is int and 0 <= x < 2**31 for x in shape):
                raise RequestError(f"shapes: {n!r} has shape {shape!r:.80}; expected a list of sizes")
            dst = m.params.get(n)
            if dst is not None:
                expected = tuple(dst.shape)
            elif n == "lm_head.weight" and m.spec.tie_word_embeddings:
                expected = tuple(m.params["model.embed_tokens.weight"].shape)
            elif n.endswith("rotary_emb.inv_freq"):
                expected = (m.spec.head_dim // 2,)
            else:
                raise RequestError(f"names: unknown parameter {n!r} for the running {m.spec.model_type}")
            if tuple(shape) != expected:
                raise RequestError(
                    f"shapes: parameter {n!r} has shape {tuple(shape)}, the running model's is {expected}"
                )
            out.append(expected)
        return names, dts, out

    def _standby_bank(self) -> CausalLM:
        """The standby copy of the weights that broadcasts land in (made on the first update, kept)."""
        if self._standby is None:
            self._standby = CausalLM(self.model.spec)
        return self._standby

    def _receive_staged(self, pg, names, dts, shapes, fmt) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
        """Engine thread: receive one update without touching the running weights. fp32 tensors land
        straight in the standby bank's views (preallocated, no copy); others (another dtype, a skipped
        name, the flattened format) in a reused staging buffer. Returns the tensors to copy in and the
        names received into the standby bank."""
        if fmt == "flattened_bucket":
            sizes = [int(torch.Size(s).numel()) * torch.empty((), dtype=d).element_size() for s, d in zip(shapes, dts)]
            total = sum(sizes)
            if self._flat_staging is None or self._flat_staging.numel() < total:
                self._flat_staging = torch.empty(total, dtype=torch.uint8)
            buf = self._flat_staging[:total]
            dist.broadcast(buf, group_src=0, group=pg)
            named, off = [], 0
            for name, size, s, d in zip(names, sizes, shapes, dts):
                named.append((name, buf[off : off + size].view(d).reshape(s)))
                off += size
            return named, []
        bank = self._standby_bank()
        named, banked, works = [], [], []
        # every receive is queued at once (as the trainer queues its sends): the collectives run back to
        # back inside gloo instead of one Python call and thread wake-up per tensor
        for name, s, d in zip(names, shapes, dts):
            dst = bank.params.get(name)
            if d == torch.float32 and dst is not None and dst.is_contiguous():
                banked.append(name)
            else:
                dst = torch.empty(s, dtype=d)
                named.append((name, dst))
            works.append(dist.broadcast(dst, group_src=0, group=pg, async_op=True))
        first_error = None
        for w in works:  # wait for all (none left writing into the bank), then raise the first failure
            try:
                w.wait()
            except (RuntimeError, dist.DistError) as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return named, banked

    def _receive(self, sched: Scheduler, pg, names, dts, shapes, fmt, flush, version) -> tuple[bool, str]:
        """Engine thread: receive the whole broadcast off the running weights, then put it in. Atomic: a
        failed receive leaves every weight as it was (the metadata was checked in ``_check_update``).
        Putting it in: a weight buffer whose every view arrived (q, k and v of a fused qkv) is swapped
        with the standby bank's (no copy; the bank then holds the old values, overwritten by the next
        update); a buffer that arrived in part, and anything staged elsewhere, is copied in."""
        t0 = time.monotonic()
        try:
            named, banked = self._receive_staged(pg, names, dts, shapes, fmt)
        except (RuntimeError, dist.DistError) as e:
            return False, f"Failed to receive weights by broadcast (no weight changed): {e}"
        t1 = time.monotonic()
        if banked:
            m, got = self.model, set(banked)
            whole = {m.group_of[n] for n in banked}
            whole = [g for g in whole if got.issuperset(m.groups[g])]
            m.swap_groups(self._standby, whole)
            swapped = {n for g in whole for n in m.groups[g]}
            named += [(n, self._standby.params[n]) for n in banked if n not in swapped]
        self.model.load_weights(named)  # names and shapes were checked: cannot fail half-way
        msg = "Succeeded to update parameter online."
        if flush and not sched.flush_cache():
            log.info("update_weights: flush_cache skipped (requests are running)")
        if version is not None:
            sched.weight_version = version
            msg += f" Weight version updated to {version}."
        log.info(
            "received %d tensors in %.3fs, put in in %.3fs (%s)",
            len(names),
            t1 - t0,
            time.monotonic() - t1,
            fmt or "per-tensor",
        )
        return True, msg

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """SGLang's ``/update_weights_from_disk``: ``{model_path, load_format?, weight_version?,
        abort_all_requests?, flush_cache?}`` -> ``{success, message, num_paused_requests}``. The files are
        read on a worker thread; the copy into the model runs on the engine thread, between two model
        steps (never mid-forward). Every tensor's name and shape are checked before any is copied, so a
        failed load leaves the running weights untouched. ``weight_version`` (when given) is set."""
        body = await _body(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            return _result(False, "update_weights_from_disk: model_path is required")
        try:
            flush = check_bool(body.get("flush_cache", True), "flush_cache")
            version = _weight_version(body.get("weight_version"), "weight_version")
            check_bool(body.get("abort_all_requests", False), "abort_all_requests")
        except RequestError as e:
            return _result(False, f"update_weights_from_disk: {e}")
        fmt = body.get("load_format")
        if fmt not in (None, "auto", "safetensors"):
            return _result(
                False, f"load_format={fmt!r} is not supported by the CPU engine (null, 'auto' or 'safetensors')"
            )
        t0 = time.monotonic()
        try:
            named = await asyncio.to_thread(self._read_checkpoint, Path(path))
        except (FileNotFoundError, KeyError, ValueError, OSError) as e:
            return _result(False, f"Failed to load weights from {path!r}: {e}")
        if body.get("abort_all_requests"):
            await self._call(lambda s: s.abort(abort_all=True))

        def apply(s: Scheduler) -> str:
            self.model.load_weights(named)  # names and shapes checked in _read_checkpoint
            if flush and not s.flush_cache():
                log.info("update_weights_from_disk: flush_cache skipped (requests are running)")
            if version is not None:
                s.weight_version = version
            return s.weight_version

        v = await self._call(apply)
        log.info("loaded %d tensors from %s in %.3fs (weight version %s)", len(named), path, time.monotonic() - t0, v)
        return _result(
            True, f"Succeeded to update model weights from {path}. Weight version {v}.", num_paused_requests=0
        )

    def _read_checkpoint(self, d: Path) -> list[tuple[str, torch.Tensor]]:
        """Read a HF safetensors checkpoint directory and check it against the running model (same names and
        shapes, no parameter missing). Errors name the directory."""
        if not d.is_dir():
            raise FileNotFoundError(f"{str(d)!r} is not a directory")
        m = self.model
        named, seen = [], set()
        for name, t in iter_safetensors(d):
            dst = m.params.get(name)
            if dst is None:
                if name == "lm_head.weight" and m.spec.tie_word_embeddings or name.endswith("rotary_emb.inv_freq"):
                    continue
                raise KeyError(f"{str(d)!r}: unknown parameter {name!r} for the running {m.spec.model_type}")
            if tuple(t.shape) != tuple(dst.shape):
                raise ValueError(
                    f"{str(d)!r}: parameter {name!r} has shape {tuple(t.shape)}, the running model's "
                    f"is {tuple(dst.shape)}"
                )
            named.append((name, t))
            seen.add(name)
        missing = m.missing_after(seen)
        if missing:
            raise ValueError(f"{str(d)!r}: checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")
        return named

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if "new_version" not in body:
            return _result(False, "new_version is required")
        try:
            v = _weight_version(body["new_version"], "new_version")
            abort_all = check_bool(body.get("abort_all_requests", True), "abort_all_requests")  # SGLang: True
        except RequestError as e:
            return _result(False, str(e))
        if v is None:
            return _result(False, "new_version must be a string, got None")

        def apply(s: Scheduler) -> None:
            if abort_all:
                s.abort(abort_all=True)
            s.weight_version = v

        await self._call(apply)
        return _result(True, f"Weight version updated to {v}", new_version=v)

    # ---- info / metrics ------------------------------------------------------------------
    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.args.model_path,
                "tokenizer_path": self.args.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.scheduler.weight_version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": self.model.spec.model_type,
                "architectures": None,
            }
        )

    async def weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.scheduler.weight_version})

    async def server_info(self, request: web.Request) -> web.Response:
        m = await self._call(lambda s: {**s.metrics(), "paused": s.paused})
        a = asdict(self.args)
        return web.json_response(
            {
                **a,
                "tp_size": 1,
                "dp_size": 1,
                "random_seed": self.args.seed,
                "enable_metrics": True,
                "device": "cpu",
                "context_length": self.scheduler.context_length,
                "weight_version": self.scheduler.weight_version,
                "max_total_num_tokens": self.scheduler.kv.max_rows * self.scheduler.context_length,
                "internal_states": [m],
                "version": ENGINE_VERSION,
            }
        )

    async def metrics(self, request: web.Request) -> web.Response:
        m = await self._call(lambda s: s.metrics())
        m[DISCONNECT_SERIES] = float(self.num_disconnect_aborts)
        return web.Response(
            text=prometheus_text(m, model_name=self.args.model_path), content_type="text/plain", charset="utf-8"
        )


# SGLang's series (name, type, help); counters are exposed with their ``_total`` name.
_SERIES = (
    ("num_running_reqs", "gauge", "The number of running requests."),
    ("num_queue_reqs", "gauge", "The number of requests in the waiting queue."),
    ("num_paused_reqs", "gauge", "The number of requests paused in place."),
    ("num_retracted_reqs", "gauge", "The number of retracted requests waiting to be re-run."),
    ("token_usage", "gauge", "The token usage of the KV cache."),
    ("cache_hit_rate", "gauge", "The prefix cache hit rate."),
    ("gen_throughput", "gauge", "The generation throughput (token/s)."),
    ("prompt_tokens_total", "counter", "Number of prefill tokens processed."),
    ("generation_tokens_total", "counter", "Number of generation tokens processed."),
    ("cached_tokens_total", "counter", "Number of cached prompt tokens."),
    ("num_requests_total", "counter", "Number of requests processed."),
    ("num_aborted_requests_total", "counter", "Number of requests aborted."),
    ("num_retractions_total", "counter", "Number of request retractions."),
    # ours: sglang 0.5.23 counts these only inside num_aborted_requests_total (``TokenizerManager.abort_request``
    # on a disconnect, ``srt/managers/tokenizer_manager.py``); named after its ``num_grammar_aborted_total``
    (
        "num_disconnect_aborted_requests_total",
        "counter",
        "Number of requests aborted because their HTTP client disconnected (timed out or gone) before the answer.",
    ),
)
DISCONNECT_SERIES = "num_disconnect_aborted_requests_total"


def prometheus_text(values: dict[str, float], *, model_name: str) -> str:
    name_ = model_name.replace('"', "'")
    label = f'{{model_name="{name_}",engine_type="unified",tp_rank="0",pp_rank="0"}}'
    lines = []
    for name, kind, help_ in _SERIES:
        full = f"sglang:{name}"
        lines.append(f"# HELP {full} {help_}")
        lines.append(f"# TYPE {full} {kind}")
        lines.append(f"{full}{label} {float(values.get(name, 0.0))!r}")
    return "\n".join(lines) + "\n"


def parse_args(argv: Optional[list[str]] = None) -> EngineArgs:
    ap = argparse.ArgumentParser(prog="python -m asyncrl.rollout.cpu_engine", description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--seed", "--random-seed", dest="seed", type=int, default=0)
    ap.add_argument("--prefix-cache-tokens", type=int, default=32768)
    ap.add_argument("--context-length", type=int, default=None)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--weight-sync-timeout-s", type=float, default=600.0)
    ap.add_argument("--nccl-port", type=int, default=None)
    ap.add_argument("--dist-timeout", dest="dist_timeout_s", type=float, default=120.0)
    ap.add_argument("--api-key", default=None, help="like SGLang's --api-key (default: $ASYNCRL_API_KEY)")
    a = ap.parse_args(argv)
    if a.max_running_requests < 1:
        ap.error("--max-running-requests must be >= 1")
    return EngineArgs(
        model_path=a.model_path,
        port=a.port,
        host=a.host,
        max_running_requests=a.max_running_requests,
        weight_version=a.weight_version,
        seed=a.seed,
        prefix_cache_tokens=a.prefix_cache_tokens,
        context_length=a.context_length,
        num_threads=a.num_threads,
        weight_sync_timeout_s=a.weight_sync_timeout_s,
        nccl_port=a.nccl_port,
        dist_timeout_s=a.dist_timeout_s,
        api_key=a.api_key or auth.current(),
    )


def init_engine_world(args: EngineArgs) -> str:
    """The engine's own one-process torch.distributed world, created the way SGLang creates its TP world
    (see module contract); returns the ``tcp://`` init method used."""
    host = args.host or "127.0.0.1"
    port = args.nccl_port
    if port is None:
        with socket.socket() as s:  # SGLang also picks a free port for its nccl_port
            s.bind((host, 0))
            port = s.getsockname()[1]
    init_method = f"tcp://{host}:{port}"
    t0 = time.monotonic()
    dist.init_process_group(
        "gloo", init_method=init_method, rank=0, world_size=1, timeout=_dt.timedelta(seconds=args.dist_timeout_s)
    )
    log.info("own torch.distributed world at %s (gloo, 1 rank) in %.2fs", init_method, time.monotonic() - t0)
    return init_method


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s cpu_engine: %(message)s"
    )
    args = parse_args(argv)
    init_engine_world(args)
    engine = CpuEngine(args)
    engine.start()
    app = engine.build_app()

    async def _ready(app: web.Application) -> None:
        log.info("The server is fired up and ready to roll! http://%s:%d", args.host, args.port)

    app.on_startup.append(_ready)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, shutdown_timeout=2.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
