"""The CPU engine's scheduler process: the model, the ``Scheduler`` and the weight updates, behind a socket pair
to the engine's HTTP process. The split SGLang makes: its HTTP process (TokenizerManager) parses and tokenizes,
its Scheduler runs in a process of its own, and the two exchange pickled objects (SGLang over ZeroMQ ipc; here
length-prefixed frames on a ``socketpair``, ``frames``: a parent and its forked child need no broker of sockets, and
a frame crosses without the two ZeroMQ I/O threads' wake-ups).

    # the HTTP process (scheduler_link.SchedulerLink.start) makes the pair, then forks this process:
    serve(args, sock=child_end, parent_end=parent_end, parent_pid=os.getppid())  # never returns

Why a process of its own: in one process the HTTP thread's Python and the engine thread's Python share one GIL
and run in series while the second core idles (concurrency 64 of ``benchmarks/engine_bench.py`` on 2 cores:
engine thread 0.45 s + HTTP thread 0.09 s of CPU in a 0.55 s run). Here the engine thread itself reads the socket
between two model steps, as SGLang's scheduler does (``Scheduler.poll_inbox``), and waits on it when idle: no
receiver thread takes the GIL from the model.

Messages (pickled tuples, one frame each)
- HTTP -> here: ``("submit", [RequestSpec, ...])``; ``("call", cid, op, args)``; ``("stop",)``.
- here -> HTTP: ``("ready", info)`` once the model is loaded and the torch.distributed world is up, or
  ``("failed", message)`` and exit status 1; ``("out", [(rid, answer), ...], state)`` after a step or a round of
  control calls that finished requests; ``("reply", cid, ok, value, state)``. ``state`` is ``(paused,
  weight_version)`` taken under the send lock: the HTTP side mirrors the two fields it answers without a call.
- ``op``: an engine-thread op (``ENGINE_OPS``) or a weight-update op (``WEIGHT_OPS``: ``WeightUpdates`` methods),
  run between two model steps on the engine thread through ``Scheduler.call``; the weight ops that wait on
  something else (``WAITING_OPS``: joining a group waits for the trainer, a load from disk reads files) run on a
  thread of their own.

Lifetime: this process dies with its parent (``PR_SET_PDEATHSIG``) and ignores SIGTERM/SIGINT (the parent, which
receives them with it as one process group, stops it with ``("stop",)``). A crash of the engine thread exits it
with status 1; the parent notices and exits with status 1 too (``scheduler_link``). The HTTP process's end closing
(it died) ends the engine loop as ``("stop",)`` does.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from tokenizers import Tokenizer

from asyncrl.cluster.process import die_with_parent
from asyncrl.cpu_engine.args import EngineArgs, init_engine_world, weight_dtype
from asyncrl.cpu_engine.frames import FrameReader, frame
from asyncrl.cpu_engine.model import load_model
from asyncrl.cpu_engine.request import Request
from asyncrl.cpu_engine.sampling_params import RequestError, SamplingParams
from asyncrl.cpu_engine.scheduler import Scheduler
from asyncrl.cpu_engine.weight_updates import WAITING_OPS, WEIGHT_OPS, WeightUpdates

log = logging.getLogger("asyncrl.cpu_engine")


@dataclass
class RequestSpec:
    """A checked request as the HTTP process hands it over (``Request`` without its callback and run state)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    created_s: float
    routed_experts_start: Optional[int] = None


def _server_info(s: Scheduler) -> dict:
    """The scheduler's entry of ``/server_info``'s ``internal_states``: its gauges and whether it is paused, without
    the request counts (``num_*``), which SGLang's does not have (a caller reads them from ``/metrics``)."""
    return {**{k: v for k, v in s.metrics().items() if not k.startswith("num_")}, "paused": s.paused}


ENGINE_OPS = {
    "ping": lambda s: True,
    "abort": lambda s, rid="", abort_all=False: s.abort(rid, abort_all=abort_all),
    "pause": lambda s, mode: s.pause(mode),
    "resume": lambda s: s.resume(),
    "flush_cache": lambda s: s.flush_cache(),
    "metrics": lambda s: s.metrics(),
    "server_info": _server_info,
}
"""Ops run on the engine thread between two model steps: name -> fn(scheduler, *args)."""


class Backend:
    """The scheduler process's state: the model, its scheduler and weight updates, the answers of the current
    step, and the socket back to the HTTP process (shared by the engine thread and the weight-op threads)."""

    def __init__(self, args: EngineArgs, *, sock: socket.socket):
        self.args = args
        self._sock = sock
        """This process's end of the pair (blocking: sends wait for room; reads never block, ``MSG_DONTWAIT``)."""
        self._frames = FrameReader()
        self._send_lock = threading.Lock()
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        t0 = time.monotonic()
        self.model = load_model(args.model_path, weight_dtype=weight_dtype(args.dtype))
        self.tokenizer = Tokenizer.from_file(str(Path(args.model_path) / "tokenizer.json"))
        self.scheduler = Scheduler(
            self.model,
            lambda ids, skip: self.tokenizer.decode(ids, skip_special_tokens=skip),
            max_running_requests=args.max_running_requests,
            seed=args.seed,
            weight_version=args.weight_version,
            prefix_cache_tokens=args.prefix_cache_tokens,
            context_length=args.context_length,
            after_step=self._flush,
            poll_inbox=self._poll,
            enable_return_routed_experts=args.enable_return_routed_experts,
        )
        self.weights = WeightUpdates(
            self.model,
            call=self._on_engine,
            timeout_s=args.weight_sync_timeout_s,
            custom_weight_loaders=args.custom_weight_loader,
        )
        self._answers: list[tuple[str, dict]] = []
        """This step's answers (``deliver`` and ``_flush`` both run on the engine thread)."""
        self._stop = threading.Event()
        self._engine_thread: Optional[threading.Thread] = None
        self._wake_r, self._wake_w = os.pipe()  # another thread's control call wakes the engine thread's poll
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = select.poll()
        self._poller.register(self._sock.fileno(), select.POLLIN)
        self._poller.register(self._wake_r, select.POLLIN)
        log.info(
            "loaded %s (%s, %d layers) in %.1fs",
            args.model_path,
            self.model.spec.model_type,
            self.model.spec.num_layers,
            time.monotonic() - t0,
        )

    def info(self) -> dict:
        s = self.scheduler
        return {
            "vocab_size": self.model.spec.vocab_size,
            "model_type": self.model.spec.model_type,
            "context_length": s.context_length,
            "max_total_num_tokens": s.kv.max_rows * s.context_length,
        }

    # ---- sending (any thread) ---------------------------------------------------------------
    def _send(self, kind: str, *fields: Any) -> None:
        """One message to the HTTP process, with the scheduler's (paused, weight_version) as of now."""
        with self._send_lock:
            state = (self.scheduler.paused, self.scheduler.weight_version)
            self._sock.sendall(frame(pickle.dumps((kind, *fields, state), protocol=pickle.HIGHEST_PROTOCOL)))

    def announce(self) -> None:
        self._sock.sendall(frame(pickle.dumps(("ready", self.info()))))

    def _deliverer(self, rid: str):
        def deliver(out: dict) -> None:
            self._answers.append((rid, out))

        return deliver

    def _flush(self) -> None:
        """Engine thread, after each step and each round of control calls: that step's answers in one message."""
        items, self._answers = self._answers, []
        if items:
            self._send("out", items)

    def _reply(self, cid: int, ok: bool, value: Any) -> None:
        try:
            self._send("reply", cid, ok, value)
        except (pickle.PicklingError, TypeError, AttributeError) as e:  # an exception that does not pickle
            self._send("reply", cid, False, RuntimeError(f"{type(value).__name__}: {value} ({e})"))

    # ---- the engine thread: model steps, and between them every message -----------------------------
    def run(self) -> None:
        """The engine loop on this thread until the HTTP process says stop; a crash exits with status 1."""
        self._engine_thread = threading.current_thread()
        try:
            self.scheduler.run(self._stop)
        except BaseException:
            log.error("engine thread crashed:\n%s", traceback.format_exc())
            sys.stderr.flush()
            os._exit(1)

    def _poll(self, timeout_s: float) -> None:
        """``Scheduler.poll_inbox``: hand every message waiting on the socket to the scheduler; when ``timeout_s``
        > 0 (idle), first wait up to that long for one (or for another thread's wake-up). As SGLang's scheduler
        reads its socket between steps: no receiver thread contends with the model for the GIL."""
        if timeout_s > 0 and dict(self._poller.poll(timeout_s * 1000)).get(self._wake_r):
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        while not self._stop.is_set():
            try:
                data = self._sock.recv(1 << 20, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            if not data:  # the HTTP process's end closed: it is gone, nobody is left to answer
                log.error("the HTTP process closed its end of the socket pair: stopping")
                self._stop.set()
                return
            for raw in self._frames.feed(data):
                if not self.receive(raw):
                    self._stop.set()
                    return

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full: the engine thread has wake-ups enough
            pass

    def _on_engine(self, fn):
        """Run ``fn(scheduler)`` on the engine thread between two steps and wait for it (at once when called there)."""
        if threading.current_thread() is self._engine_thread:
            return fn(self.scheduler)
        fut = self.scheduler.call(fn)
        self._wake()
        return fut.result()

    # ---- messages from the HTTP process (read on the engine thread) ---------------------------------
    def receive(self, raw: bytes) -> bool:
        """One message from the HTTP process; False once it asked to stop. One that cannot be read or handled is
        logged and skipped (the receiver never dies: the engine would stop taking requests)."""
        try:
            return self.handle(pickle.loads(raw))
        except Exception:
            log.exception("a message from the HTTP process (%d bytes) could not be handled: skipped", len(raw))
            return True

    def handle(self, msg: tuple) -> bool:
        """One message from the HTTP process; False once it asked to stop."""
        kind = msg[0]
        if kind == "submit":
            for spec in msg[1]:
                self._submit(spec)
        elif kind == "call":
            _, cid, op, args = msg
            self._call(cid, op, args)
        elif kind == "stop":
            return False
        else:
            log.error("unknown message %r from the HTTP process: ignored", kind)
        return True

    def _submit(self, spec: RequestSpec) -> None:
        req = Request(
            rid=spec.rid,
            input_ids=spec.input_ids,
            params=spec.params,
            return_logprob=spec.return_logprob,
            logprob_start_len=spec.logprob_start_len,
            routed_experts_start=spec.routed_experts_start,
            created_s=spec.created_s,
            deliver=self._deliverer(spec.rid),
        )
        try:
            self.scheduler.submit(req)
        except RequestError as e:  # the HTTP process checked it: answer it aborted rather than lose it
            req.finish_reason = {"type": "abort", "message": str(e)}
            self.scheduler.call(lambda s: req.deliver(s.response(req)))

    def _call(self, cid: int, op: str, args: tuple) -> None:
        if op in ENGINE_OPS:
            fn = ENGINE_OPS[op]
            fut = self.scheduler.call(lambda s: fn(s, *args))
        elif op in WEIGHT_OPS and op not in WAITING_OPS:  # on the engine thread: its own calls run at once
            method = getattr(self.weights, op)
            fut = self.scheduler.call(lambda s: method(*args))
        elif op not in WEIGHT_OPS:
            self._reply(cid, False, RequestError(f"unknown engine op {op!r}"))
            return
        else:
            threading.Thread(
                target=self._run_waiting_op, args=(cid, op, args), name=f"weights-{op}", daemon=True
            ).start()
            return
        fut.add_done_callback(lambda f: self._reply(cid, f.exception() is None, f.exception() or f.result()))

    def _run_waiting_op(self, cid: int, op: str, args: tuple) -> None:
        """A ``WAITING_OPS`` op on its own thread, its answer (or its exception) sent back."""
        try:
            value = getattr(self.weights, op)(*args)
        except BaseException as e:  # handed to the HTTP process, which answers with it
            log.error("%s failed:\n%s", op, traceback.format_exc())
            self._reply(cid, False, e)
        else:
            self._reply(cid, True, value)

    def stop(self) -> None:
        """Ask the engine loop to end (from another thread)."""
        self._stop.set()
        self._wake()


def serve(args: EngineArgs, *, sock: socket.socket, parent_end: socket.socket, parent_pid: int) -> None:
    """The scheduler process's whole life (forked from the HTTP process, ``sock`` its end of the pair and
    ``parent_end`` the HTTP process's, closed here so that the HTTP process's death reads as end of stream; exits,
    never returns)."""
    die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        os._exit(1)
    parent_end.close()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        init_engine_world(args)
        backend = Backend(args, sock=sock)
    except BaseException as e:
        log.error("the scheduler process failed to start:\n%s", traceback.format_exc())
        sock.sendall(frame(pickle.dumps(("failed", f"{type(e).__name__}: {e}"))))
        sock.close()
        os._exit(1)
    backend.announce()
    backend.run()  # until ("stop",)
    sys.stderr.flush()
    os._exit(0)


__all__ = ["ENGINE_OPS", "RequestSpec", "serve"]
