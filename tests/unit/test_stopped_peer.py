"""``asyncrl.cluster.stopped_peer`` on real processes: only a stopped process of this host, still the one named, is
killed, and one that is being stopped counts as stopped (a SIGSTOP takes effect only once its process is scheduled:
on a loaded host ``/proc`` shows ``R`` or ``S`` for a while after ``kill`` returned)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.cluster.stopped_peer import identity, kill_if_stopped

STATE_DEADLINE_S = 60.0  # a loaded CI host schedules a woken process within seconds; a minute only bounds a hang

# the main thread ends (pthread_exit: a zombie, state Z, for good) while a second thread sleeps on
_ZOMBIE_MAIN = """
import ctypes, threading, time
threading.Thread(target=time.sleep, args=(120,)).start()
ctypes.CDLL(None).pthread_exit(None)
"""


def _state(pid: int, tid: int | None = None) -> str:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    return Path(path).read_text().rsplit(")", 1)[1].split()[0]


def _wait_for_state(pid: int, want: str, *, tid: int | None = None, after: str) -> None:
    """Poll ``/proc`` until process ``pid`` (its thread ``tid``) shows state ``want``."""
    who = f"pid {pid}" if tid is None else f"thread {tid} of pid {pid}"
    deadline = time.monotonic() + STATE_DEADLINE_S
    while (state := _state(pid, tid)) != want:
        assert time.monotonic() < deadline, f"{who} still in state {state}, not {want}, {STATE_DEADLINE_S:g} s {after}"
        time.sleep(0.01)


@pytest.fixture
def spawn():
    """``spawn(code)`` -> a Python child running ``code``; SIGCONTed and killed at the test's end if still there."""
    children: list[subprocess.Popen] = []

    def start(code: str = "import time; time.sleep(120)") -> subprocess.Popen:
        children.append(subprocess.Popen([sys.executable, "-c", code]))
        return children[-1]

    yield start
    for p in children:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait(10)


@pytest.fixture
def child(spawn):
    return spawn()


def test_a_stopped_process_is_killed(child):
    ident = identity(child.pid)
    os.kill(child.pid, signal.SIGSTOP)
    _wait_for_state(child.pid, "T", after="after SIGSTOP")
    done = kill_if_stopped(ident)
    assert done is not None and f"pid {child.pid}, state T" in done
    assert child.wait(10) == -signal.SIGKILL


def test_a_process_sigstopped_an_instant_ago_is_killed(child):
    """Right after ``kill(SIGSTOP)`` the SIGSTOP is pending or taken: either way the process is being stopped."""
    ident = identity(child.pid)
    os.kill(child.pid, signal.SIGSTOP)
    done = kill_if_stopped(ident)
    assert done is not None and f"pid {child.pid}, " in done and "SIGKILLed it" in done
    assert child.wait(10) == -signal.SIGKILL


def test_a_stopped_thread_counts_when_the_main_thread_is_not_in_state_t(spawn):
    """A group stop shows per thread; here the main thread is a zombie whose state stays Z, its other thread stops."""
    p = spawn(_ZOMBIE_MAIN)
    _wait_for_state(p.pid, "Z", after="after start (the main thread's pthread_exit)")
    ident = identity(p.pid)
    (tid,) = (int(t) for t in os.listdir(f"/proc/{p.pid}/task") if int(t) != p.pid)
    os.kill(p.pid, signal.SIGSTOP)
    _wait_for_state(p.pid, "T", tid=tid, after="after SIGSTOP")
    done = kill_if_stopped(ident)
    assert done is not None and f"pid {p.pid}, thread {tid} in state T, main thread Z" in done
    assert p.wait(10) == -signal.SIGKILL


def test_a_running_process_is_left_alone(child):
    assert kill_if_stopped(identity(child.pid)) is None
    assert child.poll() is None


def test_only_the_process_named_and_only_here(child):
    """Another start time (the pid taken again), another boot (another host, or before a reboot), another pid
    namespace (another container), or no identity at all: nothing is killed, stopped or not."""
    boot, ns, pid, start = identity(child.pid).rsplit(":", 3)
    os.kill(child.pid, signal.SIGSTOP)
    _wait_for_state(child.pid, "T", after="after SIGSTOP")
    for other in (
        f"{boot}:{ns}:{pid}:{int(start) + 1}",
        f"00000000-0000-0000-0000-000000000000:{ns}:{pid}:{start}",
        f"{boot}:1:{pid}:{start}",
        "not an identity",
        f"{boot}:{ns}:999999999:{start}",
    ):
        assert kill_if_stopped(other) is None, other
    assert child.poll() is None  # still there, stopped


def test_identity_is_stable_and_names_its_process(child):
    assert identity(child.pid) == identity(child.pid) != identity()
    assert identity().rsplit(":", 3)[2] == str(os.getpid())
    with pytest.raises(ProcessLookupError):
        identity(999999999)
