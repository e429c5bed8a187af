"""``asyncrl.cluster.stopped_peer`` on real processes: only a stopped process of this host, still the one named, is
killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from asyncrl.cluster.stopped_peer import identity, kill_if_stopped


@pytest.fixture
def child():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield p
    if p.poll() is None:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.wait(10)


def test_a_stopped_process_is_killed(child):
    ident = identity(child.pid)
    os.kill(child.pid, signal.SIGSTOP)
    done = kill_if_stopped(ident)
    assert done is not None and f"pid {child.pid}, state T" in done
    assert child.wait(10) == -signal.SIGKILL


def test_a_running_process_is_left_alone(child):
    assert kill_if_stopped(identity(child.pid)) is None
    assert child.poll() is None


def test_only_the_process_named_and_only_here(child):
    """Another start time (the pid taken again), another boot (another host, or before a reboot), another pid
    namespace (another container), or no identity at all: nothing is killed, stopped or not."""
    boot, ns, pid, start = identity(child.pid).rsplit(":", 3)
    os.kill(child.pid, signal.SIGSTOP)
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
