"""The CPU engine: an HTTP server that speaks SGLang's API (the subset an RL trainer uses).

    python -m asyncrl.rollout.cpu_engine --model-path DIR --port P [--host H]
        [--max-running-requests N] [--weight-version V] [--seed S] [--nccl-port P] [--dist-timeout S]

Contract (see shared/notes/sglang-http-protocol.md; the same client and trainer code drive SGLang)
- Threads: the aiohttp event loop answers HTTP; one engine thread runs ``Scheduler.run`` (model
  steps, continuous batching). Handlers never touch scheduler state directly: requests go through
  ``Scheduler.submit`` and every control action through ``Scheduler.call`` (runs between two model
  steps).
- The parts: flags and start-up (``engine_args``: SGLang's own one-process torch.distributed world before the
  model loads), the ``/generate`` body checks and SGLang's answer shapes (``engine_http``), the weight updates
  (``weight_updates``: the group, the atomic receive, loads from disk), the ``/metrics`` page
  (``engine_metrics``). This module holds the engine object, the generation, control and info handlers, and
  ``main``.
- Status codes as SGLang: 400 with ``{"error": {"message"}}`` for bad generate requests; control
  calls answer ``{"success", "message"}`` with 200/400; ``/flush_cache`` answers text, 400 while
  requests are running.
- A ``/generate`` whose HTTP client disconnects (timeout, killed) has its requests aborted, as SGLang does; they
  count in ``sglang:num_aborted_requests_total`` (as SGLang) and in ``sglang:num_disconnect_aborted_requests_total``
  on ``/metrics`` (ours: SGLang has no separate series).
- A crash of the engine thread exits the process with status 1 (the launcher restarts it).
- The process runs with a short GIL switch interval (``ENGINE_SWITCH_INTERVAL_S``): the HTTP thread's bursts
  interleave with the engine thread's torch ops instead of stalling them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
from aiohttp import web
from tokenizers import Tokenizer

from asyncrl.cluster.auth import bearer_matches, open_path
from asyncrl.cluster.malloc import retain_freed_memory
from asyncrl.rollout.cpu_model import load_model
from asyncrl.rollout.cpu_scheduler import PAUSE_MODES, Scheduler
from asyncrl.rollout.engine_args import EngineArgs, init_engine_world, parse_args
from asyncrl.rollout.engine_http import Outbox, build_generate_requests, json_error, read_body
from asyncrl.rollout.engine_metrics import DISCONNECT_SERIES, prometheus_text
from asyncrl.rollout.request import Request
from asyncrl.rollout.sampling_params import RequestError, check_bool, parse_sampling_params
from asyncrl.rollout.weight_updates import WeightUpdates

__all__ = ["CpuEngine", "EngineArgs", "main", "parse_args"]

log = logging.getLogger("asyncrl.cpu_engine")

ENGINE_VERSION = "asyncrl-cpu-engine-0.1"
HEALTH_CHECK_TIMEOUT_S = 20.0  # as SGLang's default SGLANG_HEALTH_CHECK_TIMEOUT
DISCONNECT_POLL_S = 0.2  # how often a waiting /generate checks that its client is still connected
# The interpreter's GIL switch interval in the engine process (CPython's default is 5 ms). The engine thread drops
# the GIL in every torch op; when the HTTP thread takes it then (a delivery's wake-up, a new request) it keeps it for
# its whole burst, up to the interval, while the engine thread waits to re-enter Python. At 0.2 ms the engine thread
# gets it back within 0.2 ms and the HTTP thread's Python runs beside the engine's next torch op instead of in
# series with it. Measured on the c64 workload of benchmarks/engine_bench.py (2 cores): the engine thread's time in
# the self-pipe write of its deliveries fell from 0.35 s to 0.14-0.20 s over 3 runs, median run 0.63 -> 0.52 s.
ENGINE_SWITCH_INTERVAL_S = 0.0002


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
            after_step=self._flush_outbox,
        )
        self._outbox: Optional[Outbox] = None
        """Finished requests' answers to the event loop, one wake-up per step (made when the loop starts)."""
        self.weights = WeightUpdates(self.model, call=self._call, timeout_s=args.weight_sync_timeout_s)
        """The weight-update group, the receiver and the loads from disk (``weight_updates``)."""
        self.num_disconnect_aborts = 0
        self._waiting: dict[int, tuple[web.Request, list[Request], asyncio.Future]] = {}
        """Waiting ``/generate`` calls (request, its requests, set when its client went away), by id."""
        self._watcher: Optional[asyncio.Task] = None
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

    def _flush_outbox(self) -> None:
        if self._outbox is not None:
            self._outbox.flush()

    async def _open_outbox(self, app: web.Application) -> None:
        self._outbox = Outbox(asyncio.get_running_loop())

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
        self.weights.add_routes(r)
        r.add_route("*", "/flush_cache", self.flush_cache)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/weight_version", "/get_weight_version"):
            r.add_get(path, self.weight_version)
        r.add_get("/metrics", self.metrics)
        app.on_startup.append(self._open_outbox)
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
            return json_error(str(e))

    # ---- generation ----------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        reqs, futs, batch = build_generate_requests(
            body,
            encode=lambda t: self.tokenizer.encode(t).ids,
            vocab_size=self.model.spec.vocab_size,
            context_length=self.scheduler.context_length,
            outbox=self._outbox,
        )
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
        the requests are aborted at once -- as SGLang does on disconnect -- instead of generating for nobody
        (``_watch_disconnects`` notices; None is returned)."""
        gathered = asyncio.gather(*futs)
        gone = asyncio.get_running_loop().create_future()
        self._waiting[id(gone)] = (request, reqs, gone)
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._watch_disconnects())
        try:
            await asyncio.wait({gathered, gone}, return_when=asyncio.FIRST_COMPLETED)
            return None if gone.done() else gathered.result()
        except asyncio.CancelledError:  # the server cancelled the handler (shutdown): abort its requests
            self._abort(reqs)
            raise
        finally:
            self._waiting.pop(id(gone), None)
            if not gathered.done():
                gathered.cancel()

    async def _watch_disconnects(self) -> None:
        """One task for every waiting ``/generate`` (not one timer per request): every ``DISCONNECT_POLL_S``, the
        requests of clients that went away are aborted and their handlers woken. Ends when none waits."""
        try:
            while self._waiting:
                await asyncio.sleep(DISCONNECT_POLL_S)
                for request, reqs, gone in list(self._waiting.values()):
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
        if self.scheduler.paused is not None:  # a paused scheduler runs no request: ask it a control call instead
            try:
                await asyncio.wait_for(self._call(lambda s: True), HEALTH_CHECK_TIMEOUT_S)
            except asyncio.TimeoutError:
                return web.Response(status=503)
            return web.Response(status=200)
        fut = self._outbox.loop.create_future()
        req = Request(
            rid=f"HEALTH_CHECK_{time.time()}",
            input_ids=[0],
            params=parse_sampling_params({"max_new_tokens": 1, "temperature": 0.0}),
            deliver=self._outbox.deliverer(fut),
        )
        self.scheduler.submit(req)
        try:
            await asyncio.wait_for(fut, HEALTH_CHECK_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.scheduler.call(lambda s: s.abort(req.rid))
            return web.Response(status=503)
        return web.Response(status=200)

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        rid, abort_all = body.get("rid", ""), check_bool(body.get("abort_all", False), "abort_all")
        if not isinstance(rid, str):
            raise RequestError(f"rid must be a string, got {rid!r:.80}")
        await self._call(lambda s: s.abort(rid, abort_all=abort_all))
        return web.Response(status=200)

    # ---- pause / continue ----------------------------------------------------------------
    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await read_body(request)
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode={mode!r} is not one of {list(PAUSE_MODES)}")
        await self._call(lambda s: s.pause(mode))
        log.info("paused (%s)", mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await read_body(request, required=False)
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


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s cpu_engine: %(message)s"
    )
    args = parse_args(argv)
    retain_freed_memory()  # each decode step's activations reuse the last one's memory (cluster/malloc.py)
    sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
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
