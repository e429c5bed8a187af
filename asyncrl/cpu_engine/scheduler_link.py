"""The CPU engine's HTTP process's side of its scheduler process (``scheduler_process``): start it, hand it requests
and control calls, route its answers to the waiting handlers, and exit when it dies.

    link = SchedulerLink.start(args)     # forks the scheduler process, waits for its model (or exits 1)
    await link.open()                     # in the event loop: starts reading its answers
    link.submit(reqs)                     # checked Requests; each one's deliver(answer) runs on the loop
    n = await link.call("abort", rid)     # an engine op or a weight op (scheduler_process.ENGINE_OPS / WEIGHT_OPS)
    link.paused, link.weight_version      # mirrored from every message it sends
    await link.output_after(t, timeout_s=20)  # True once any message arrived after monotonic time t (health)

Contract
- ``start`` makes a ``socketpair`` (messages: pickled tuples in ``frames``), forks (before this process has any
  thread: the fork copies none) and waits for ``("ready", info)``; a scheduler process that fails to load or dies
  first makes ``start`` raise ``SchedulerFailed`` naming why. On the event loop (``open``) the pair's end is an
  asyncio transport: answers are read as they arrive, and sends never block the loop (the transport buffers).
- A message that cannot be read (does not unpickle, or has the wrong fields) is logged and skipped.
- ``submit`` checks what ``Scheduler.submit`` checks (empty prompt, context length, a rid already in flight) for
  the whole list before sending any of it (all or nothing), so a duplicate rid is still a 400 at once.
- A scheduler process that exits unexpectedly (its engine thread crashed: status 1) takes this process with it:
  a watcher thread logs its exit status and exits with status 1, as one engine process did (the launcher restarts
  it). ``stop`` asks it to stop and waits; it never outlives this process (``PR_SET_PDEATHSIG``).
- On the event loop, ``aclose`` stops it without blocking the loop: its answers keep being read until it exits
  (``stop``'s blocking wait, run there, deadlocked: the scheduler process blocked sending answers nobody read and
  never read "stop"), then ``stop`` reaps it (killed if it did not exit in time).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import pickle
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

from asyncrl.cpu_engine.args import EngineArgs
from asyncrl.cpu_engine.frames import FrameReader, frame
from asyncrl.cpu_engine.request import Request
from asyncrl.cpu_engine.scheduler import check_submittable, duplicate_rid
from asyncrl.cpu_engine.scheduler_process import RequestSpec, serve

log = logging.getLogger("asyncrl.cpu_engine")

READY_POLL_S = 0.5  # how often start() checks that the scheduler process still lives while it loads
STOP_WAIT_S = 10.0


class SchedulerFailed(RuntimeError):
    """The scheduler process failed to start or died."""


class SchedulerLink:
    def __init__(self, args: EngineArgs):
        self.args = args
        self.sock, self.child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        """This process's end of the pair, and the scheduler process's (closed here once it is forked)."""
        self._frames = FrameReader()
        self._transport: Optional[asyncio.Transport] = None
        self.proc: Optional[multiprocessing.process.BaseProcess] = None
        self.info: dict = {}
        self.paused: Optional[str] = None
        self.weight_version: str = args.weight_version
        self._live: dict[str, Callable[[dict], None]] = {}
        """Requests sent and not yet answered: rid -> deliver."""
        self._calls: dict[int, asyncio.Future] = {}
        self._cids = itertools.count()
        self._stopping = False
        self.last_receive = time.monotonic()
        """When the last message of the scheduler process arrived (SGLang's ``last_receive_tstamp``)."""
        self._receive_waiters: list[asyncio.Future] = []
        self._closed: Optional[asyncio.Future] = None
        """Set once the scheduler process's end of the pair closed (it exited), while open on the event loop."""

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
            kwargs={"sock": self.child_end, "parent_end": self.sock, "parent_pid": os.getpid()},
            name="cpu-engine-scheduler",
            daemon=False,
        )
        self.proc.start()
        self.child_end.close()  # the scheduler process's death then reads as end of stream here

    def _wait_ready(self) -> None:
        t0 = time.monotonic()
        got: list[bytes] = []
        while not got:
            if select.select([self.sock], [], [], READY_POLL_S)[0]:
                data = self.sock.recv(1 << 20)
                if data:
                    got = self._frames.feed(data)
                    continue
                self.proc.join(STOP_WAIT_S)  # end of stream: it exited
            if not self.proc.is_alive():
                raise SchedulerFailed(f"the scheduler process exited with status {self.proc.exitcode} while starting")
        if len(got) > 1:  # nothing is sent before "ready": a second message is a bug of the scheduler process
            raise SchedulerFailed(f"the scheduler process sent {len(got)} messages at once while starting")
        msg = pickle.loads(got[0])
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

    def stop(self, grace_s: float = STOP_WAIT_S) -> None:
        """Ask the scheduler process to stop, wait up to ``grace_s`` s, kill it if it did not; close the pair."""
        self._stopping = True
        if self.proc is not None and self.proc.is_alive():
            try:
                self._send(("stop",))
            except OSError:  # its end is gone or full: killed below if it does not stop
                pass
            self.proc.join(grace_s)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(STOP_WAIT_S)
        if self._transport is not None:
            self._transport.abort()
        self.sock.close()
        self.child_end.close()

    # ---- the event loop --------------------------------------------------------------------------
    async def open(self) -> None:
        """Start reading the scheduler process's answers on the running loop (and sending through its transport)."""
        loop = asyncio.get_running_loop()
        self._closed = loop.create_future()
        self._transport, _ = await loop.connect_accepted_socket(lambda: _Reader(self), self.sock)

    async def aclose(self, grace_s: float) -> None:
        """``stop`` from the event loop (see module contract): "stop" sent, its answers read until its end closes
        (at most ``grace_s`` s), then reaped."""
        self._stopping = True
        if self._closed is not None and self.proc is not None and self.proc.is_alive():
            try:
                self._send(("stop",))
                await asyncio.wait_for(asyncio.shield(self._closed), grace_s)
            except OSError:  # its end is gone: it is exiting, reaped below
                pass
            except asyncio.TimeoutError:
                log.warning("the scheduler process %d did not stop within %g s: killing it", self.proc.pid, grace_s)
        closed = self._closed is not None and self._closed.done()  # it is exiting: reap it; else kill it now
        self.stop(grace_s=STOP_WAIT_S if closed else 0.0)

    def received(self, data: bytes) -> None:
        """Bytes from the scheduler process: every whole message, in order; one that cannot be read is logged and
        skipped (the reader never dies: every later answer would be lost with it)."""
        for raw in self._frames.feed(data):
            try:
                self._handle(pickle.loads(raw))
            except Exception:
                log.exception("a message from the scheduler process (%d bytes) could not be handled: skipped", len(raw))

    async def output_after(self, t: float, *, timeout_s: float) -> bool:
        """True as soon as a message of the scheduler process arrived after monotonic time ``t``; False when none
        did within ``timeout_s`` (SGLang's health check: any scheduler output counts)."""
        deadline = t + timeout_s
        while self.last_receive <= t:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            fut = asyncio.get_running_loop().create_future()
            self._receive_waiters.append(fut)
            try:
                await asyncio.wait_for(fut, left)
            except asyncio.TimeoutError:
                return self.last_receive > t
            finally:
                if fut in self._receive_waiters:
                    self._receive_waiters.remove(fut)
        return True

    def _handle(self, msg: tuple) -> None:
        self.last_receive = time.monotonic()
        for fut in self._receive_waiters:
            if not fut.done():
                fut.set_result(None)
        self._receive_waiters.clear()
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
                    routed_experts_start=req.routed_experts_start,
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
        """One message: through the loop's transport once open (never blocks: it buffers), else on the socket."""
        data = frame(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)
        else:
            self.sock.sendall(data)


class _Reader(asyncio.Protocol):
    """The event loop's reader of the pair: bytes to ``SchedulerLink.received``."""

    def __init__(self, link: SchedulerLink):
        self.link = link

    def data_received(self, data: bytes) -> None:
        self.link.received(data)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if self.link._closed is not None and not self.link._closed.done():
            self.link._closed.set_result(None)
        if not self.link._stopping:  # the watcher exits this process once the scheduler process is reaped
            log.error("the scheduler process closed its end of the socket pair (%s)", exc or "end of stream")
