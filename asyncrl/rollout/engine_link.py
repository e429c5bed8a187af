"""The CPU engine's HTTP process's side of its scheduler process (``engine_backend``): start it, hand it requests
and control calls, route its answers to the waiting handlers, and exit when it dies.

    link = SchedulerLink.start(args)     # forks the scheduler process, waits for its model (or exits 1)
    await link.open()                     # in the event loop: starts reading its answers
    link.submit(reqs)                     # checked Requests; each one's deliver(answer) runs on the loop
    n = await link.call("abort", rid)     # an engine op or a weight op (engine_backend.ENGINE_OPS / WEIGHT_OPS)
    link.paused, link.weight_version      # mirrored from every message it sends

Contract
- ``start`` binds two ZeroMQ ipc sockets in a private temporary directory, forks (before this process has any
  thread: the fork copies none) and waits for ``("ready", info)``; a scheduler process that fails to load or dies
  first makes ``start`` raise ``SchedulerFailed`` naming why.
- ``submit`` checks what ``Scheduler.submit`` checks (empty prompt, context length, a rid already in flight) for
  the whole list before sending any of it (all or nothing), so a duplicate rid is still a 400 at once.
- A scheduler process that exits unexpectedly (its engine thread crashed: status 1) takes this process with it:
  a watcher thread logs its exit status and exits with status 1, as one engine process did (the launcher restarts
  it). ``stop`` asks it to stop and waits; it never outlives this process (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import zmq
import zmq.asyncio

from asyncrl.rollout.cpu_scheduler import check_submittable, duplicate_rid
from asyncrl.rollout.engine_args import EngineArgs
from asyncrl.rollout.engine_backend import RequestSpec, serve
from asyncrl.rollout.request import Request

log = logging.getLogger("asyncrl.cpu_engine")

READY_POLL_S = 0.5  # how often start() checks that the scheduler process still lives while it loads
STOP_WAIT_S = 10.0


class SchedulerFailed(RuntimeError):
    """The scheduler process failed to start or died."""


class SchedulerLink:
    def __init__(self, args: EngineArgs):
        self.args = args
        self._dir = tempfile.mkdtemp(prefix="asyncrl-engine-")
        self.to_backend, self.from_backend = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(self.to_backend)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.from_backend)
        self.proc: Optional[multiprocessing.process.BaseProcess] = None
        self.info: dict = {}
        self.paused: Optional[str] = None
        self.weight_version: str = args.weight_version
        self._live: dict[str, Callable[[dict], None]] = {}
        """Requests sent and not yet answered: rid -> deliver."""
        self._calls: dict[int, asyncio.Future] = {}
        self._cids = itertools.count()
        self._stopping = False
        self._reader: Optional[asyncio.Task] = None

    # ---- start / stop (the main thread) -----------------------------------------------------------
    @classmethod
    def start(cls, args: EngineArgs) -> SchedulerLink:
        link = cls(args)
        try:
            link._fork()
            link._wait_ready()
        except BaseException:
            link.stop()
            raise
        threading.Thread(target=link._watch, name="scheduler-watch", daemon=True).start()
        return link

    def _fork(self) -> None:
        ctx = multiprocessing.get_context("fork")
        self.proc = ctx.Process(
            target=serve,
            args=(self.args,),
            kwargs={"to_backend": self.to_backend, "from_backend": self.from_backend, "parent_pid": os.getpid()},
            name="cpu-engine-scheduler",
            daemon=False,
        )
        self.proc.start()

    def _wait_ready(self) -> None:
        t0 = time.monotonic()
        while not self._pull.poll(int(READY_POLL_S * 1000)):
            if not self.proc.is_alive():
                raise SchedulerFailed(f"the scheduler process exited with status {self.proc.exitcode} while starting")
        msg = pickle.loads(self._pull.recv())
        if msg[0] == "failed":
            self.proc.join(STOP_WAIT_S)
            raise SchedulerFailed(f"the scheduler process failed to start: {msg[1]}")
        if msg[0] != "ready":
            raise SchedulerFailed(f"the scheduler process said {msg[0]!r} before 'ready'")
        self.info = msg[1]
        log.info("scheduler process %d ready in %.1fs", self.proc.pid, time.monotonic() - t0)

    def _watch(self) -> None:
        """Exit this process (status 1) when the scheduler process dies without being asked to stop."""
        self.proc.join()
        if not self._stopping:
            log.error("the scheduler process %d exited with status %s: exiting", self.proc.pid, self.proc.exitcode)
            sys.stderr.flush()
            os._exit(1)

    def stop(self) -> None:
        self._stopping = True
        if self.proc is not None and self.proc.is_alive():
            try:
                self._push.send(pickle.dumps(("stop",)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.proc.join(STOP_WAIT_S)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(STOP_WAIT_S)
        self._push.close()
        self._pull.close()
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- the event loop --------------------------------------------------------------------------
    async def open(self) -> None:
        """Start reading the scheduler process's answers on the running loop."""
        self._reader = asyncio.create_task(self._read(zmq.asyncio.Socket.from_socket(self._pull)))

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        """Every message of the scheduler process, in order; one that cannot be read is logged and skipped (the
        reader never dies: every later answer would be lost with it)."""
        while True:
            raw = await sock.recv()
            try:
                self._handle(pickle.loads(raw))
            except Exception:
                log.exception("a message from the scheduler process (%d bytes) could not be handled: skipped", len(raw))

    def _handle(self, msg: tuple) -> None:
        kind, state = msg[0], msg[-1]
        if kind in ("out", "reply"):
            self.paused, self.weight_version = state
        if kind == "out":
            for rid, answer in msg[1]:
                deliver = self._live.pop(rid, None)
                if deliver is not None:
                    deliver(answer)
        elif kind == "reply":
            _, cid, ok, value, _ = msg
            fut = self._calls.pop(cid, None)
            if fut is not None and not fut.done():
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value if isinstance(value, BaseException) else RuntimeError(str(value)))
        else:
            log.error("unknown message %r from the scheduler process: ignored", kind)

    def submit(self, reqs: list[Request]) -> None:
        """Hand checked requests to the scheduler (all or nothing: ``RequestError`` before any is sent)."""
        seen = set()
        for req in reqs:
            check_submittable(req, self.info["context_length"])
            if req.rid in self._live or req.rid in seen:
                raise duplicate_rid(req.rid)
            seen.add(req.rid)
        specs = []
        for req in reqs:
            self._live[req.rid] = req.deliver
            specs.append(
                RequestSpec(
                    rid=req.rid,
                    input_ids=req.input_ids,
                    params=req.params,
                    return_logprob=req.return_logprob,
                    logprob_start_len=req.logprob_start_len,
                    created_s=req.created_s,
                )
            )
        self._send(("submit", specs))

    def call(self, op: str, *args: Any) -> asyncio.Future:
        """Run an op in the scheduler process; the future holds its result (or raises its exception)."""
        cid = next(self._cids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[cid] = fut
        self._send(("call", cid, op, args))
        return fut

    def _send(self, msg: tuple) -> None:
        self._push.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
