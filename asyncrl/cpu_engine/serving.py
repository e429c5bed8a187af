"""The CPU engine's HTTP serving loop and its stop on SIGTERM / SIGINT (``server.main`` runs it).

    code = serve(engine, app, sock, url)   # returns 0 once stopped by a signal

Contract
- Serves ``app`` on the already bound ``sock`` until the first SIGTERM or SIGINT; a signal after that (Slurm's
  ``scancel`` signals every process of the job and the engine's rank then stops its children with SIGTERM too) is
  logged and ignored, until the process has exited: the stop already under way finishes, never cut short.
- The stop, bounded (at most about ``DRAIN_S + ABORT_WAIT_S + 2 * HANDLER_WAIT_S + SCHEDULER_STOP_S`` s, well
  inside the launcher's grace ``cluster.shutdown_grace_s``; about ``DRAIN_S`` s with requests in flight, at once
  without): the port stops taking connections; the ``/generate`` calls in flight get up to ``DRAIN_S`` s to finish
  (SGLang drains them too, with no bound of its own); the rest are aborted in the scheduler process, so each of
  them is answered as SGLang answers an aborted request (200, ``finish_reason`` ``abort``, the output so far),
  not with a dropped connection; other calls still waiting (a health check, a weight call waiting for its
  trainer, a ``/generate`` held at the pause gate) are cancelled after ``HANDLER_WAIT_S`` s; then the scheduler
  process is asked to stop while this loop keeps reading what it still sends (``SchedulerLink.aclose``); exit 0.
- Why not ``aiohttp.web.run_app``: its SIGTERM handler stays armed during its own clean-up, so a second SIGTERM
  raised ``GracefulExit`` in the middle of it: the clean-up was cancelled, the handlers' tasks were cancelled
  while aiohttp's connection shutdown still waited on them (``InvalidStateError`` tracebacks from
  ``web_protocol``), the scheduler process was never told to stop, and the exit hung in ``multiprocessing``'s
  join of it until the launcher's SIGKILL. And its clean-up stopped the scheduler process with a blocking join
  on the event loop: nobody read the answers the scheduler process was still sending, it blocked on a full
  socket, never read "stop", and was killed after 10 s.
- Exit status 0 where SGLang's ends with 137: after its drain SGLang SIGKILLs its own process tree, itself included
  (``kill_process_tree(os.getpid(), include_parent=True)``), an artefact of how it exits, not a signal of failure.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

from aiohttp import web

log = logging.getLogger("asyncrl.cpu_engine")

DRAIN_S = 2.0
"""How long the ``/generate`` calls in flight at a stop may run on before they are aborted."""
ABORT_WAIT_S = 2.0
"""How long the aborted calls get to receive their answers from the scheduler process."""
HANDLER_WAIT_S = 1.0
"""aiohttp's wait for the handlers still running at the stop, before and after it cancels them."""
SCHEDULER_STOP_S = 3.0
"""How long the scheduler process gets to exit after "stop" before it is killed."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def serve(engine, app: web.Application, sock: socket.socket, url: str) -> int:
    """Serve ``app`` (of ``engine``: a ``server.CpuEngine``) on ``sock`` until a stop signal; 0 once stopped."""
    try:
        return asyncio.run(_serve(engine, app, sock, url))
    finally:  # Python's finalization puts SIG_DFL back for a handler (a signal would then kill the exit), not for SIG_IGN
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)


async def _serve(engine, app: web.Application, sock: socket.socket, url: str) -> int:
    loop = asyncio.get_running_loop()
    stop: asyncio.Future = loop.create_future()

    def on_loop(signum: signal.Signals) -> None:
        if stop.done():
            log.info("%s again: the stop already under way goes on", signum.name)
        else:
            stop.set_result(signum)

    def on_signal(signum: int, frame) -> None:
        """A plain handler, not ``loop.add_signal_handler``'s: the loop's is taken back (SIG_DFL) when it closes, and
        a signal in the last moments of the exit would then kill this process; this one stays for its whole life."""
        try:
            loop.call_soon_threadsafe(on_loop, signal.Signals(signum))
        except RuntimeError:  # the loop is closed: the stop is done, the process is exiting
            pass

    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=HANDLER_WAIT_S)
    await runner.setup()  # on_startup: the scheduler link opens on this loop
    site = web.SockSite(runner, sock, backlog=1024)
    await site.start()
    for signum in STOP_SIGNALS:
        signal.signal(signum, on_signal)
    log.info("The server is fired up and ready to roll! %s", url)
    signum = await stop
    log.info("%s received: stopping (%d /generate call(s) in flight)", signum.name, len(engine.waiting))
    await site.stop()  # no new connections
    await _drain(engine)
    await runner.cleanup()  # closes the connections; on_cleanup stops the scheduler process (SchedulerLink.aclose)
    log.info("stopped")
    return 0


async def _drain(engine) -> None:
    """The ``/generate`` calls in flight get ``DRAIN_S`` s to finish; the rest are aborted and answered."""
    if await _settled(engine, DRAIN_S):
        return
    log.info("aborting the %d /generate call(s) still in flight", len(engine.waiting))
    try:
        await asyncio.wait_for(engine.link.call("abort", "", True), ABORT_WAIT_S)
    except asyncio.TimeoutError:
        log.warning("the scheduler process did not answer the abort within %g s", ABORT_WAIT_S)
        return
    if not await _settled(engine, ABORT_WAIT_S):
        log.warning("%d /generate call(s) got no answer after the abort: cancelled", len(engine.waiting))


async def _settled(engine, timeout_s: float) -> bool:
    """True once no ``/generate`` call waits for its answer (at most ``timeout_s`` s)."""
    try:
        await asyncio.wait_for(engine.none_waiting.wait(), timeout_s)
    except asyncio.TimeoutError:
        return False
    return True


__all__ = ["serve"]
