"""Child-process supervision: spawn with a log file, die with the parent, tear down by PID.

Contract
- Every child (broker, engine, retrieval server) is started through ``spawn_child``: its own
  session (so a signal to it reaches its whole tree), stdout+stderr into ``<run_dir>/logs/NAME.log``
  (``console_stdout``: stdout stays the console's, e.g. the broker's warnings),
  and ``PR_SET_PDEATHSIG = SIGKILL`` on Linux so it cannot outlive a SIGKILLed parent. Its
  environment is this process's plus ``env``, or exactly ``env`` with ``inherit_env=False``
  (engines: ``asyncrl.engine.launch.engine_environment`` strips torchrun's variables). A child
  ignores SIGUSR1 (the preemption notice, ``asyncrl.trainer.guards``).
- ``stop_all()`` (also run at exit and on SIGTERM/SIGINT once ``install_signal_handlers`` ran)
  sends SIGTERM (the child's ``stop_signal``: SIGINT for the broker, which defers SIGTERM while its
  parent lives) to every live child's process group, waits ``grace_s``, then SIGKILLs.
- ``wait_until(pred, timeout_s, what, child=...)`` is the one readiness wait: it times out with a
  clear error, says "still waiting" now and then, and fails at once if the child died (with the
  last lines of its log).
- ``fail_fast_on_exit(child)``: a watcher thread that, when a child the rank cannot live without
  (the broker) exits without ``stop_child`` having been asked to, prints an error naming it (exit
  code, log tail), stops the other children and exits the rank with status 1 within about a
  second, so torchrun tears the job down (or restarts it under ``--max-restarts``).
- ``fail_fast_on_hang(child, probe=, hung_after_s=)``: a watcher thread that probes a child the rank cannot live
  without (the broker: ``broker.client.BrokerPing``) every second; when it is alive but answered nothing for
  ``hung_after_s``, fails the rank the same way, naming it as hung.
- ``fail_rank(message)``: the same exit for a fault outside the rank (a rank that saw an actor rank's heartbeat
  stop: ``asyncrl.trainer.leader_phases.watch_actor_ranks``).
- ``start_parent_watchdog()``: torchrun starts every rank in its own session, so a SIGKILLed
  torchrun takes no rank with it; each rank watches its parent pid and, once it changed (the
  agent is gone), stops its children and exits. Children in turn die with their rank
  (``PR_SET_PDEATHSIG``; spawn them from the main thread: the signal follows the spawning thread).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("asyncrl.process")

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Runs in a child (between fork and exec, or first thing after a bare fork): SIGKILL when the parent dies."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the job's preemption notice is for actor rank 0 alone
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: rely on stop_all()
        pass


class ChildFailed(RuntimeError):
    """A supervised child exited unexpectedly or never became ready."""


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log_path: Path
    stopping: bool = False
    """Set by ``stop_child``: the exit that follows is asked for, not a failure."""
    stop_signal: signal.Signals = signal.SIGTERM
    """What ``stop_child`` sends first (SIGINT for a child that defers SIGTERM while its parent lives: the broker)."""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        return tail_file(self.log_path, n)


_children: list[Child] = []
_handlers_installed = False


def tail_file(path: Path, n: int = 30) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log yet)"
    return "\n".join(lines[-n:])


def spawn_child(
    name: str,
    cmd: list[str],
    *,
    log_dir: str | Path,
    env: dict | None = None,
    cwd: str | None = None,
    inherit_env: bool = True,
    console_stdout: bool = False,
    stop_signal: signal.Signals = signal.SIGTERM,
) -> Child:
    """``console_stdout``: the child's stdout stays the parent's (the console), only stderr goes to the log
    (a child that prints its operator-facing warnings to stdout and logs everything to stderr).
    ``stop_signal``: what ``stop_child`` sends before SIGKILL."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    out = open(log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
    full_env = dict(os.environ) if inherit_env else {}
    if env:
        full_env.update(env)
    popen = subprocess.Popen(
        cmd,
        stdout=None if console_stdout else out,
        stderr=out if console_stdout else subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=full_env,
        cwd=cwd,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    out.close()
    child = Child(name=name, popen=popen, log_path=log_path, stop_signal=stop_signal)
    _children.append(child)
    log.info("started %s (pid %d), log %s", name, popen.pid, log_path)
    return child


def stop_child(child: Child, grace_s: float = 10.0) -> None:
    child.stopping = True
    if child.alive():
        try:
            os.killpg(child.pid, child.stop_signal)
        except ProcessLookupError:
            pass
        try:
            child.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning(
                "%s (pid %d) ignored %s for %.0fs; killing", child.name, child.pid, child.stop_signal.name, grace_s
            )
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.popen.wait(timeout=5)
    if child in _children:
        _children.remove(child)


def stop_all(grace_s: float = 10.0) -> None:
    for child in list(reversed(_children)):
        stop_child(child, grace_s)


def install_signal_handlers(grace_s: float = 10.0) -> None:
    """SIGTERM/SIGINT: stop children, then exit 128+signum. Idempotent."""
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True

    def handler(signum, frame):
        stop_all(grace_s)
        sys.stderr.write(f"asyncrl: stopped by signal {signum}\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    atexit.register(stop_all, grace_s)


def wait_until(
    pred: Callable[[], bool],
    *,
    timeout_s: float,
    what: str,
    child: Child | None = None,
    interval_s: float = 0.2,
    report_every_s: float = 30.0,
) -> None:
    t0 = time.monotonic()
    last_report = t0
    while True:
        if pred():
            return
        now = time.monotonic()
        if child is not None and not child.alive():
            raise ChildFailed(
                f"{child.name} exited with code {child.popen.returncode} while waiting for {what}; "
                f"last lines of {child.log_path}:\n{child.tail()}"
            )
        if now - t0 > timeout_s:
            extra = f"; last lines of {child.log_path}:\n{child.tail()}" if child is not None else ""
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}{extra}")
        if now - last_report > report_every_s:
            log.info("still waiting for %s (%.0fs)", what, now - t0)
            last_report = now
        time.sleep(interval_s)


# How often the watcher threads look at a child / the parent pid: well inside the "noticed in seconds" budget.
WATCH_INTERVAL_S = 0.2
# Grace given to the children when a rank dies because its parent or a vital child is gone: short, so
# that nothing of the job outlives the failure by more than a few seconds (children also get SIGKILL
# from PR_SET_PDEATHSIG when the rank exits).
_FAIL_FAST_GRACE_S = 3.0


def _fail_fast(message: str, grace_s: float, code: int = 1) -> None:
    """Stop the children and exit, whatever happens on the way: the console may have died with the parent (a
    write to its closed pipe raises ``BrokenPipeError``, which once killed the watchdog thread and left the rank
    and its engine running as orphans)."""
    try:
        sys.stderr.write(f"asyncrl: {message}\n")
        sys.stderr.flush()
        log.error(message)
    except (OSError, ValueError):
        pass
    finally:
        try:
            stop_all(min(grace_s, _FAIL_FAST_GRACE_S))
        finally:
            os._exit(code)


def fail_rank(what_happened: str, grace_s: float) -> None:
    """Fail this rank at once (children stopped, exit 1) because of something outside it, e.g. a hung actor rank 0
    seen from a rollout rank: torchrun then stops the job."""
    _fail_fast(f"{what_happened}; failing this rank so that torchrun stops the job", grace_s)


def _fail_vital(child: Child, what_happened: str, grace_s: float) -> None:
    """``_fail_fast`` for a child the rank cannot live without (dead or hung): the same message tail for both."""
    _fail_fast(
        f"{what_happened}; failing this rank so that torchrun stops the job (with --max-restarts it restarts it "
        f"and runner.resume=true resumes from the last complete checkpoint). Last lines of "
        f"{child.log_path}:\n{child.tail()}",
        grace_s,
    )


def fail_fast_on_exit(
    child: Child, *, what: str, grace_s: float = 10.0, interval_s: float = WATCH_INTERVAL_S
) -> threading.Thread:
    """Watch ``child`` on a daemon thread; if it exits without ``stop_child``, fail this rank at once."""

    def watch() -> None:
        while not child.stopping:
            if not child.alive() and not child.stopping:
                _fail_vital(child, f"{what} (pid {child.pid}) exited with code {child.popen.returncode}", grace_s)
            time.sleep(interval_s)

    t = threading.Thread(target=watch, name=f"watch-{child.name}", daemon=True)
    t.start()
    return t


def fail_fast_on_hang(
    child: Child,
    *,
    what: str,
    probe: Callable[[float], bool],
    hung_after_s: float,
    grace_s: float = 10.0,
    interval_s: float = 1.0,
) -> threading.Thread:
    """Probe ``child`` on a daemon thread (``probe(timeout_s)`` -> it answered; an exception counts as no answer);
    if it is alive but answered nothing for ``hung_after_s`` (stopped, deadlocked, starved), fail this rank at once,
    naming it. Its death is ``fail_fast_on_exit``'s."""

    def answered() -> bool:
        try:
            return probe(interval_s)
        except Exception as e:  # noqa: BLE001 - a failing probe is a missing answer; the hang check decides
            log.debug("probe of %s failed: %r", what, e)
            time.sleep(interval_s)
            return False

    def watch() -> None:
        last = time.monotonic()
        while not child.stopping:
            t0 = time.monotonic()
            if answered():
                last = time.monotonic()
                time.sleep(max(0.0, interval_s - (last - t0)))
            elif child.alive() and not child.stopping and time.monotonic() - last > hung_after_s:
                _fail_vital(
                    child,
                    f"{what} (pid {child.pid}) is alive but answered no heartbeat for {time.monotonic() - last:.0f} s "
                    f"(> {hung_after_s:.0f} s): hung (stopped, deadlocked or starved)",
                    grace_s,
                )

    t = threading.Thread(target=watch, name=f"hang-watch-{child.name}", daemon=True)
    t.start()
    return t


def start_parent_watchdog(*, grace_s: float = 10.0, interval_s: float = WATCH_INTERVAL_S) -> threading.Thread:
    """Exit (after stopping the children) once this process's parent is gone (see module contract)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        _fail_fast(
            f"parent process {parent} (the torchrun agent) is gone; stopping this rank's children and exiting", grace_s
        )

    t = threading.Thread(target=watch, name="parent-watchdog", daemon=True)
    t.start()
    return t
