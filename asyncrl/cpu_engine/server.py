"""The CPU engine: an HTTP server that speaks SGLang's API (the subset an RL trainer uses).

    python -m asyncrl.cpu_engine.server --model-path DIR --port P [--host H]
        [--max-running-requests N] [--weight-version V] [--seed S] [--nccl-port P] [--dist-timeout S]

Contract (see shared/notes/sglang-http-protocol.md; the same client and trainer code drive SGLang)
- Two processes, as SGLang: this one answers HTTP (aiohttp, the tokenizer, every body check); its scheduler
  process (``scheduler_process``, forked at start, dies with it) holds the model and runs ``Scheduler.run`` (model
  steps, continuous batching) and the weight updates. ``scheduler_link.SchedulerLink`` joins them over a socketpair:
  checked requests go over, finished answers come back once per model step, and every control action is a
  named op run between two model steps.
- The parts: flags and start-up (``args``: SGLang's own one-process torch.distributed world, made in the
  scheduler process before the model loads), the ``/generate`` body checks and SGLang's answer shapes
  (``http_shapes``), the weight updates (``weight_updates``: the group, the atomic receive, loads from disk), the
  ``/metrics`` page (``metrics``). This module holds the HTTP handlers and ``main``.
- Status codes and shapes as SGLang: a body SGLang's request struct refuses is its validation 400 (``http_shapes``);
  400 with ``{"error": {"message"}}`` for other bad generate requests; control calls answer
  ``{"success", "message"}`` with 200/400; ``/flush_cache`` answers text, 400 while requests are running;
  unknown paths and wrong methods FastAPI's 404 / 405 ``{"detail"}``.
- A ``/generate`` whose HTTP client disconnects (timeout, killed) has its requests aborted, as SGLang does; they
  count in ``sglang:num_aborted_requests_total`` (as SGLang) and in ``sglang:num_disconnect_aborted_requests_total``
  on ``/metrics`` (ours: SGLang has no separate series).
- Start-up as SGLang's: the port answers only once the model is loaded; a model that fails to load exits the
  process with status 1 naming why. A crash of the engine thread (the scheduler process exits 1) exits this
  process with status 1 (the launcher restarts it). SIGTERM/SIGINT: a bounded stop, status 0 (``serving``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from aiohttp import web
from tokenizers import Tokenizer

from asyncrl.cluster.auth import bearer_matches, open_path
from asyncrl.cluster.malloc import retain_freed_memory
from asyncrl.cpu_engine.args import EngineArgs, env_bool, parse_args
from asyncrl.cpu_engine.http_shapes import (
    FLUSH_FAILED,
    FLUSHED,
    InvalidBody,
    ModelUpdateLock,
    build_generate_requests,
    json_error,
    model_info_body,
    read_body,
    result,
    validation_error,
)
from asyncrl.cpu_engine.metrics import DISCONNECT_SERIES, HELD_SERIES, prometheus_text
from asyncrl.cpu_engine.request import Request
from asyncrl.cpu_engine.sampling_params import RequestError, parse_sampling_params
from asyncrl.cpu_engine.scheduler import PAUSE_MODES
from asyncrl.cpu_engine.scheduler_link import SchedulerFailed, SchedulerLink
from asyncrl.cpu_engine.serving import SCHEDULER_STOP_S, serve
from asyncrl.cpu_engine.weight_updates import WEIGHT_ROUTES
from asyncrl.models.spec import load_hf_config

__all__ = ["CpuEngine", "EngineArgs", "main", "parse_args"]

log = logging.getLogger("asyncrl.cpu_engine")

ENGINE_VERSION = "asyncrl-cpu-engine-0.1"
HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLang's default SGLANG_HEALTH_CHECK_TIMEOUT (read from the environment as SGLang)
HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
"""SGLang's switch (default on): off, ``/health`` answers from the server's status alone (``/health_generate``
still generates)."""
LOCKED_OPS = frozenset(
    {"begin_weight_update", "end_weight_update", "update_weights_from_distributed", "update_weights_from_disk"}
) | {"update_weights_from_tensor"}
"""Weight calls that SGLang runs under its model-update writer lock when the engine is not paused."""
DISCONNECT_POLL_S = 0.2  # how often a waiting /generate checks that its client is still connected
IDLE_POLL_S = 0.1  # longest wait between two idle checks of a /flush_cache?timeout= (one follows each output too)


class CpuEngine:
    """The HTTP side of one engine: its handlers, over ``link`` (the scheduler process, already started)."""

    def __init__(self, args: EngineArgs, link: SchedulerLink, tokenizer: Tokenizer):
        self.args = args
        self.link = link
        self.tokenizer = tokenizer
        self.model_path = args.model_path
        """SGLang's ``model_path`` and ``served_model_name`` on ``/model_info``: a load from disk moves both."""
        self.load_format = "auto"
        """SGLang's ``load_format`` in effect (its default, then the one of the last load from disk)."""
        self.architectures = load_hf_config(args.model_path).get("architectures")
        self.server_status = "Up"
        """SGLang's ``ServerStatus`` as its HTTP side keeps it: ``Up`` (this port answers only once the model is
        loaded, so never ``Starting``), ``UnHealthy`` after a failed health generation, ``Up`` again after one that
        succeeds. ``/ready`` and ``/ping`` answer from it."""
        self.health_timeout_s = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", HEALTH_CHECK_TIMEOUT_S))
        self.health_generation = env_bool(HEALTH_GENERATION_ENV, True)
        self.unpaused = asyncio.Event()
        """SGLang's pause gate in its HTTP process (``is_pause``): cleared by ``/pause_generation``, set by
        ``/continue_generation``; a ``/generate`` arriving meanwhile waits here, before its checks, outside the
        scheduler (not queued there, not reached by ``/abort_request``), as on SGLang."""
        self.unpaused.set()
        self.num_held = 0
        """``/generate`` calls waiting at the pause gate now."""
        self.num_gate_aborts = 0
        """``/generate`` calls dropped at the gate: their client left during the pause (never reached the scheduler)."""
        self.update_lock = ModelUpdateLock()
        self.num_disconnect_aborts = 0
        """Requests aborted because their HTTP client disconnected before the answer."""
        self.waiting: dict[int, tuple[web.Request, list[Request], asyncio.Future]] = {}
        """Waiting ``/generate`` calls (request, its requests, set when its client went away), by id; ``none_waiting``
        is set while there are none (``serving`` drains them at a stop)."""
        self.none_waiting = asyncio.Event()
        self.none_waiting.set()
        self._flush_waiting = False
        """A ``/flush_cache?timeout=`` is waiting for the engine to be idle (SGLang: its pending flush)."""
        self._abortable: set[str] = set()
        """Rids of this server's ``/generate`` requests in the scheduler, unanswered, no abort sent for them yet:
        SGLang's ``rid_to_state`` entries without ``abort_sent``. ``/abort_request`` by rid reaches only these."""
        self._watcher: Optional[asyncio.Task] = None
        """The task of ``_watch_disconnects`` while any ``/generate`` waits."""
        self.unauthorized = 0
        """Requests refused for a missing or wrong API key."""

    @staticmethod
    def load_tokenizer(args: EngineArgs) -> Tokenizer:
        tok_path = Path(args.model_path) / "tokenizer.json"
        if not tok_path.is_file():
            raise FileNotFoundError(f"model path {args.model_path!r}: no tokenizer.json")
        return Tokenizer.from_file(str(tok_path))

    async def _open(self, app: web.Application) -> None:
        await self.link.open()

    def _call(self, op: str, *args):
        return self.link.call(op, *args)

    # ---- app -----------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        """SGLang's routes with its methods: FastAPI serves a GET route without HEAD (405), so none here does."""
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._auth, self._errors])
        r = app.router

        def get(path: str, handler) -> None:
            r.add_get(path, handler, allow_head=False)

        for path in ("/generate",):
            r.add_post(path, self.generate)
            r.add_put(path, self.generate)
        get("/health", self.health)
        get("/health_generate", self.health)
        get("/ready", self.ready)
        get("/ping", self.ping)
        get("/get_weights_by_name", self.get_weights_by_name)
        r.add_post("/get_weights_by_name", self.get_weights_by_name)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        for path, op in WEIGHT_ROUTES.items():
            if op != "get_weights_by_name":
                r.add_post(path, self._weight_op(op))
        get("/flush_cache", self.flush_cache)
        r.add_post("/flush_cache", self.flush_cache)
        for path in ("/model_info", "/get_model_info"):
            get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            get(path, self.server_info)
        r.add_route("*", "/metrics", self.metrics)  # SGLang mounts its metrics app there: any method
        app.on_startup.append(self._open)
        app.on_cleanup.append(lambda app: self.link.aclose(SCHEDULER_STOP_S))  # never blocks the loop: see serving
        return app

    def _weight_op(self, op: str):
        """The handler of one weight call: its body to the scheduler process's op, SGLang's answer back."""

        async def handler(request: web.Request) -> web.Response:
            body = await read_body(request)
            if op in LOCKED_OPS and body.get("abort_all_requests"):  # SGLang's HTTP side: before the lock
                await self._call("abort", "", True)
            if self.unpaused.is_set() and op in LOCKED_OPS:  # SGLang: the writer side unless paused
                async with self.update_lock.writing():
                    ok, message, extra = await self._call(op, body)
            else:
                ok, message, extra = await self._call(op, body)
            if ok and op == "update_weights_from_disk":
                self.model_path, self.load_format = body["model_path"], body.get("load_format") or "auto"
            return result(ok, message, **extra)

        return handler

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's ``/get_weights_by_name`` (GET or POST, body ``{name, truncate_size}``): the parameter's first
        ``truncate_size`` entries as a JSON list, or 400 ``{"error": {"message": ...}}``."""
        ok, message, extra = await self._call("get_weights_by_name", await read_body(request))
        return web.json_response(extra["parameter"]) if ok else json_error(message)

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
        """A ``RequestError`` is a 400 with SGLang's shape for it; an unknown path or a wrong method is answered as
        FastAPI answers them (its default handlers: SGLang's own cover only ``fastapi.HTTPException``)."""
        try:
            return await handler(request)
        except InvalidBody as e:
            return validation_error(str(e))
        except RequestError as e:
            return json_error(str(e))
        except web.HTTPNotFound:
            return web.json_response({"detail": "Not Found"}, status=404)
        except web.HTTPMethodNotAllowed as e:
            allow = ", ".join(sorted(e.allowed_methods))
            return web.json_response({"detail": "Method Not Allowed"}, status=405, headers={"Allow": allow})

    # ---- generation ----------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        if not self.unpaused.is_set():
            self.num_held += 1
            try:
                await self.unpaused.wait()
            finally:
                self.num_held -= 1
            if request.transport is None or request.transport.is_closing():  # its client left during the pause
                self.num_disconnect_aborts += 1
                self.num_gate_aborts += 1
                return web.Response(status=499)
        async with self.update_lock.reading():
            reqs, futs, batch = build_generate_requests(
                body,
                encode=lambda t: self.tokenizer.encode(t).ids,
                vocab_size=self.link.info["vocab_size"],
                context_length=self.link.info["context_length"],
                loop=asyncio.get_running_loop(),
            )
            self.link.submit(reqs)  # all or nothing: a RequestError (a 400) before any is sent
            for req, fut in zip(reqs, futs):
                self._abortable.add(req.rid)
                fut.add_done_callback(lambda _, rid=req.rid: self._abortable.discard(rid))
            outs = await self._wait_or_abort(request, reqs, futs)
        if outs is None:  # the client went away: its requests were aborted; nobody reads this answer
            return web.Response(status=499)
        if not batch and len(outs) == 1:
            return web.json_response(outs[0])
        return web.json_response(list(outs))

    def _abort(self, reqs: list[Request]) -> None:
        for req in reqs:
            self._abortable.discard(req.rid)
            self._call("abort", req.rid)

    async def _wait_or_abort(self, request: web.Request, reqs: list[Request], futs: list) -> Optional[list]:
        """Wait for every request's output. When the HTTP client disconnects (its timeout fired, it was killed)
        the requests are aborted at once -- as SGLang does on disconnect -- instead of generating for nobody
        (``_watch_disconnects`` notices; None is returned)."""
        gathered = asyncio.gather(*futs)
        gone = asyncio.get_running_loop().create_future()
        self.waiting[id(gone)] = (request, reqs, gone)
        self.none_waiting.clear()
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._watch_disconnects())
        try:
            await asyncio.wait({gathered, gone}, return_when=asyncio.FIRST_COMPLETED)
            return None if gone.done() else gathered.result()
        except asyncio.CancelledError:  # the server cancelled the handler (shutdown): abort its requests
            self._abort(reqs)
            raise
        finally:
            self.waiting.pop(id(gone), None)
            if not self.waiting:
                self.none_waiting.set()
            if not gathered.done():
                gathered.cancel()
                gathered.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no asyncio warning

    async def _watch_disconnects(self) -> None:
        """One task for every waiting ``/generate`` (not one timer per request): every ``DISCONNECT_POLL_S``, the
        requests of clients that went away are aborted and their handlers woken. Ends when none waits."""
        try:
            while self.waiting:
                await asyncio.sleep(DISCONNECT_POLL_S)
                for request, reqs, gone in list(self.waiting.values()):
                    transport = request.transport
                    if (transport is None or transport.is_closing()) and not gone.done():
                        rid = reqs[0].rid if reqs else "?"
                        log.info("client of %d request(s) disconnected (rid %s...): aborting them", len(reqs), rid)
                        self._abort(reqs)
                        self.num_disconnect_aborts += len(reqs)
                        gone.set_result(None)
        finally:
            self._watcher = None

    async def health(self, request: web.Request) -> web.Response:
        """SGLang's ``/health`` and ``/health_generate``: a 1-token generation is submitted (while paused it waits
        for the resume, as SGLang's does at its pause gate), and the answer is 200 as soon as ANY output of the
        scheduler process arrives after the call began (a token, a control call's reply), else 503 after
        ``SGLANG_HEALTH_CHECK_TIMEOUT`` s, which also marks the server ``UnHealthy`` (``/ready`` and ``/ping``
        then answer 503 until a health generation succeeds). With ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``
        off, ``/health`` answers 200 from the status alone. (SGLang checks once a second, so it never answers
        before 1 s; this answers at the first output: a difference in latency only.)"""
        if request.path == "/health" and not self.health_generation:
            return web.Response(status=200)
        tic = time.monotonic()
        req = Request(
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
            input_ids=[0],
            params=parse_sampling_params({"max_new_tokens": 1, "temperature": 0.0}),
            deliver=lambda out: None,
        )
        self.link.submit([req])
        try:
            if await self.link.output_after(tic, timeout_s=self.health_timeout_s):
                self.server_status = "Up"
                return web.Response(status=200)
        finally:
            self._call("abort", req.rid)
        log.error(
            "Health check failed: no output from the scheduler process for %g s (paused: %s)",
            self.health_timeout_s,
            self.link.paused,
        )
        self.server_status = "UnHealthy"
        return web.Response(status=503)

    async def ready(self, request: web.Request) -> web.Response:
        """SGLang's ``/ready``: 200 when not paused and healthy (an open path, no key needed)."""
        return web.Response(status=200 if self.unpaused.is_set() and self.server_status == "Up" else 503)

    async def ping(self, request: web.Request) -> web.Response:
        """SGLang's ``/ping``: 200 when healthy, paused or not (it needs the key)."""
        return web.Response(status=200 if self.server_status == "Up" else 503)

    async def abort_request(self, request: web.Request) -> web.Response:
        """SGLang's ``/abort_request``: ``abort_all``, or a rid that must be exactly one of ``_abortable`` (anything
        else is dropped: a prefix, an answered request, one held at the pause gate, a second abort); the scheduler
        then aborts every request whose rid starts with it. 200, empty, whatever happened."""
        body = await read_body(request)  # rid and abort_all checked there
        rid, abort_all = body.get("rid") or "", body.get("abort_all", False)
        if abort_all:
            await self._call("abort", "", True)
        elif rid in self._abortable:
            self._abortable.discard(rid)
            await self._call("abort", rid, False)
        return web.Response(status=200)

    # ---- pause / continue ----------------------------------------------------------------
    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await read_body(request)).get("mode", "abort")  # one of PAUSE_MODES: checked there
        assert mode in PAUSE_MODES, mode
        self.unpaused.clear()
        await self._call("pause", mode)
        log.info("paused (%s)", mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await read_body(request)
        await self._call("resume")
        self.unpaused.set()
        log.info("continued")
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        """SGLang's ``/flush_cache[?timeout=T]``: text, 200 when flushed, 400 "Flush cache failed." when refused
        (requests running, or waiting while not paused). With ``T > 0`` and requests in the engine it waits up to T s
        for none to be running or waiting (re-checked at each output of the scheduler process), then flushes or
        answers "Timed out waiting for idle state."; any flush meanwhile: "Another flush_cache is already in
        progress." (SGLang keeps that wait in its scheduler; its answers are the same.)"""
        raw = request.query.get("timeout", "0")
        try:
            timeout_s = float(raw)
        except ValueError:
            timeout_s = math.nan
        if not timeout_s >= 0:  # SGLang: a query parameter (float, >= 0) FastAPI validates
            raise InvalidBody(f"query.timeout: expected a number >= 0, got {raw!r:.80}")
        if self._flush_waiting:
            return web.Response(text="Another flush_cache is already in progress.", status=400)
        if timeout_s == 0 or await self._idle():
            ok = await self._call("flush_cache")
        else:
            ok = await self._flush_when_idle(time.monotonic() + timeout_s)
            if ok is None:
                return web.Response(text="Timed out waiting for idle state.", status=400)
        return web.Response(text=FLUSHED if ok else FLUSH_FAILED, status=200 if ok else 400)

    async def _idle(self) -> bool:
        m = await self._call("metrics")
        return m["num_running_reqs"] == 0 and m["num_queue_reqs"] == 0

    async def _flush_when_idle(self, deadline: float) -> Optional[bool]:
        """The flush once no request runs or waits (its result), or None at ``deadline``."""
        self._flush_waiting = True
        try:
            while time.monotonic() < deadline:
                t = self.link.last_receive  # (at or after) the answer of the last check: wait for anything newer
                await self.link.output_after(t, timeout_s=min(IDLE_POLL_S, max(0.0, deadline - time.monotonic())))
                if await self._idle():
                    return await self._call("flush_cache")
            return None
        finally:
            self._flush_waiting = False

    # ---- weight updates ------------------------------------------------------------------
    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            model_info_body(
                self.model_path,
                tokenizer_path=self.args.model_path,
                weight_version=self.link.weight_version,
                load_format=self.load_format,
                model_type=self.link.info["model_type"],
                architectures=self.architectures,
            )
        )

    async def server_info(self, request: web.Request) -> web.Response:
        state = await self._call("server_info")
        a = asdict(self.args)
        return web.json_response(
            {
                **a,
                "tp_size": 1,
                "dp_size": 1,
                "random_seed": self.args.seed,
                "enable_metrics": True,
                "device": "cpu",
                "context_length": self.link.info["context_length"],
                "weight_version": self.link.weight_version,
                "max_total_num_tokens": self.link.info["max_total_num_tokens"],
                "internal_states": [state],
                "version": ENGINE_VERSION,
            }
        )

    async def metrics(self, request: web.Request) -> web.Response:
        m = await self._call("metrics")
        m[DISCONNECT_SERIES] = float(self.num_disconnect_aborts)
        m[HELD_SERIES] = float(self.num_held)
        m["num_aborted_requests_total"] = m.get("num_aborted_requests_total", 0.0) + self.num_gate_aborts
        return web.Response(
            text=prometheus_text(m, model_name=self.args.model_path), content_type="text/plain", charset="utf-8"
        )


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s cpu_engine: %(message)s"
    )
    args = parse_args(argv)
    retain_freed_memory()  # each decode step's activations reuse the last one's memory (cluster/malloc.py)
    try:
        link = SchedulerLink.start(args)  # forks the scheduler process first: this one has no thread yet
    except SchedulerFailed as e:
        log.error("%s", e)
        return 1
    try:
        tokenizer = CpuEngine.load_tokenizer(args)
    except (OSError, ValueError, RuntimeError) as e:
        log.error("%s", e)
        link.stop()
        return 1
    try:  # bound here, so "ready" is only logged once the port is ours, and a taken port is a one-line error
        sock = socket.create_server(
            (args.host, args.port), family=socket.AF_INET6 if ":" in args.host else socket.AF_INET, backlog=1024
        )
    except OSError as e:  # SGLang's server exits 1 on this too (its HTTP server cannot bind)
        log.error("cannot listen on %s:%d: %s (another process holds the port? change --port)", args.host, args.port, e)
        link.stop()
        return 1
    engine = CpuEngine(args, link, tokenizer)
    try:
        return serve(engine, engine.build_app(), sock, f"http://{args.host}:{args.port}")
    finally:
        link.stop(SCHEDULER_STOP_S)  # already stopped unless serving failed: never left to multiprocessing's join


if __name__ == "__main__":
    sys.exit(main())
