"""End a SIGSTOPped peer rank on this host instead of waiting for torchrun to.

Contract
- ``identity(pid)`` names one process for good: ``"<boot id>:<pid namespace>:<pid>:<start time>"`` (the kernel's
  boot id, the inode of the process's pid namespace, and its start time in clock ticks since boot, from
  ``/proc/<pid>/stat``). A rank publishes its own; a pid taken again by another process, a process of another host,
  of another container or of the host before a reboot never matches it.
- ``kill_if_stopped(ident)``: when ``ident`` is a process this one can see (same boot, same pid namespace, same start
  time) and it is stopped or being stopped, SIGKILL it and return what was done; else None (another host, gone,
  running, hung in a call: those are torchrun's, which SIGTERMs them and SIGKILLs after its shutdown timeout).
  "Stopped or being stopped" is read from the kernel, never assumed from the time since a signal: a SIGSTOP pending
  (sent, not yet taken: the process may still show ``R`` or ``S`` until it is scheduled, long after on a loaded host),
  or any of its threads in state ``T`` (a group stop, by SIGSTOP or a terminal stop, reaches the threads one by one,
  and the main thread may be the last, or a zombie whose state never changes). The pending signals are read before
  the thread states: a SIGSTOP taken between the two reads has left its thread in ``T`` by the second.
- Why: a stopped process cannot act on SIGTERM, so when an actor rank is SIGSTOPped, torchrun waits out its whole
  30 s shutdown timeout before its SIGKILL ends the job. The rank that saw the stopped rank's heartbeat stop
  (``asyncrl.trainer.leader_phases.watch_actor_ranks``) ends it itself, at once; the outcome is the same (the job fails,
  naming the rank), 30 s sooner.

    ident = identity()                  # published by each actor rank
    done = kill_if_stopped(ident)       # by a watcher, once that rank's heartbeat stopped
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Optional


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def _stat(pid: int) -> Optional[tuple[str, int]]:
    """(state, start time in ticks) of ``pid`` from ``/proc/<pid>/stat``; None if there is no such process here."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw.rsplit(")", 1)[1].split()  # after "pid (comm)": the comm may hold spaces and parentheses
    return fields[0], int(fields[19])


def _pid_namespace(pid: int) -> str:
    try:
        return str(os.stat(f"/proc/{pid}/ns/pid").st_ino)
    except OSError:
        return "unknown"


def identity(pid: Optional[int] = None) -> str:
    """The identity of process ``pid`` (this one by default); see the contract."""
    pid = os.getpid() if pid is None else pid
    st = _stat(pid)
    if st is None:
        raise ProcessLookupError(f"no process {pid} in /proc")
    return f"{_boot_id()}:{_pid_namespace(pid)}:{pid}:{st[1]}"


_SIGSTOP_MASK = 1 << (signal.SIGSTOP - 1)  # bit n-1 of /proc's SigPnd/ShdPnd masks is signal n


def _stop_seen(pid: int) -> Optional[str]:
    """How process ``pid`` is seen stopped or being stopped (see the contract), or None when it is not."""
    task_dir = Path(f"/proc/{pid}/task")
    try:
        tids = sorted(os.listdir(task_dir), key=int)
    except OSError:  # gone
        return None
    pending, states = 0, {}
    for tid in tids:  # first the pending signals of every thread, then their states (the contract says why)
        try:
            for line in (task_dir / tid / "status").read_text().splitlines():
                if line.startswith(("SigPnd:", "ShdPnd:")):
                    pending |= int(line.split()[1], 16)
        except OSError:  # a thread that ended meanwhile: nothing of its own is pending any more
            continue
    for tid in tids:
        try:
            states[tid] = (task_dir / tid / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
    if states.get(str(pid)) == "T":
        return "state T"
    stopped = [tid for tid, state in states.items() if state == "T"]
    if stopped:
        return f"thread {stopped[0]} in state T, main thread {states.get(str(pid), '?')}"
    return "SIGSTOP pending" if pending & _SIGSTOP_MASK else None


def kill_if_stopped(ident: str) -> Optional[str]:
    """SIGKILL the process ``ident`` names if it is this host's, still the same process, and stopped or being stopped;
    returns what was done, or None when nothing was."""
    try:
        boot, ns, pid_s, start_s = ident.rsplit(":", 3)
        pid, start = int(pid_s), int(start_s)
    except ValueError:
        return None
    if boot != _boot_id() or "unknown" in (boot, ns) or ns != _pid_namespace(os.getpid()):
        return None
    st = _stat(pid)
    if st is None or st[1] != start:
        return None
    seen = _stop_seen(pid)
    if seen is None:
        return None
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return None
    return f"it was stopped (pid {pid}, {seen}) and could not act on torchrun's SIGTERM: SIGKILLed it"


__all__ = ["identity", "kill_if_stopped"]
