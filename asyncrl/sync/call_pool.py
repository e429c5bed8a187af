"""The weight sync's pool of kept daemon threads for its blocking HTTP calls to the engines.

Contract
- ``CallPool.submit(fn, *args, **kwargs)`` runs the call on a thread of the pool and returns its
  ``concurrent.futures.Future`` at once; ``fan_out(urls, call, timeout_s=, step=)`` is
  ``asyncrl.engine.blocking.fan_out`` on the pool (answers in engine order, the first failure raises,
  the laggards are named at the deadline).
- Every call gets a thread at once (an idle one, else a new one): a call blocked on a dead engine
  (until its own timeout) never delays a later call. Threads are daemons (``blocking`` says why) and
  end after ``idle_exit_s`` without work.

    pool = CallPool()
    answers = pool.fan_out(urls, lambda u: post_json(u, "/flush_cache", {}, timeout_s=60, step="flush_cache"),
                           timeout_s=61, step="flush_cache")
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from asyncrl.engine.blocking import wait_all

# A CallPool thread idle this long ends: syncs come far more often (every step or few), so the threads of a
# running job are kept; a pool nobody uses any more (a syncer dropped) leaves no thread behind for long.
_IDLE_EXIT_S = 300.0


class CallPool:
    """Daemon threads, kept from one sync to the next, that run the sync's blocking HTTP calls.

    ``submit`` hands a call to an idle thread through a queue, without waiting: starting a fresh
    thread per call (``blocking.spawn``) makes the caller wait until the new thread runs, and on a
    loaded host each such hand-off was a visible share of the sync's fixed cost. Every call gets a
    thread of its own at once (one is started when none is idle), so a call still blocked on a dead
    engine (until its own timeout) never delays a later one. A thread idle for ``idle_exit_s`` ends.
    Daemon threads, as ``blocking`` says why.
    """

    def __init__(self, *, idle_exit_s: float = _IDLE_EXIT_S) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a job and not promised one: waiting threads = queued jobs + idle
        self.idle_exit_s = idle_exit_s

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> cf.Future:
        fut: cf.Future = cf.Future()
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # promised to this job
        self._jobs.put((fut, fn, args, kwargs))
        if start:
            threading.Thread(target=self._work, name="sync-call", daemon=True).start()
        return fut

    def fan_out(self, urls: Sequence[str], call: Callable[[str], Any], *, timeout_s: float, step: str) -> list[Any]:
        """``blocking.fan_out`` on this pool: ``call(url)`` for every engine at once, answers in order."""
        return wait_all({self.submit(call, u): u for u in urls}, timeout_s=timeout_s, step=step)

    def _work(self) -> None:
        while True:
            try:
                fut, fn, args, kwargs = self._jobs.get(timeout=self.idle_exit_s)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # an unpromised thread may go; a promised one waits for its job
                        self._idle -= 1
                        return
                continue
            ran, result, error = fut.set_running_or_notify_cancel(), None, None
            if ran:
                try:
                    result = fn(*args, **kwargs)
                except BaseException as e:  # noqa: BLE001 - handed to the waiter, never swallowed
                    error = e
            with self._lock:  # idle again BEFORE the waiter wakes: its next call finds this thread
                self._idle += 1
            if ran and error is None:
                fut.set_result(result)
            elif ran:
                fut.set_exception(error)
            del fut, fn, args, kwargs, result, error  # hold nothing while idle
