"""Leader-only phases (``asyncrl.runner.leader``) over a real TCPStore, the leader and a follower as threads."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from asyncrl.runner.leader import LeaderFailed, LeaderPhases


@pytest.fixture
def stores():
    """A TCPStore server and client connections to it (each ``LeaderPhases`` user gets its own)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), use_libuv=True)
    opened = []

    def client():
        s = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30), use_libuv=True)
        opened.append(s)
        return dist.PrefixStore("run/", s)

    yield client
    opened.clear()  # clients first, then the server goes with the fixture's frame


def _follow(follower: LeaderPhases, name: str, out: dict, timeout_s=None) -> threading.Thread:
    def body():
        t0 = time.monotonic()
        try:
            out["result"] = follower.run(
                name, lambda: pytest.fail("a follower must not run the phase"), timeout_s=timeout_s
            )
        except LeaderFailed as e:
            out["error"] = e
        out["waited_s"] = time.monotonic() - t0

    t = threading.Thread(target=body)
    t.start()
    return t


def test_follower_waits_for_the_leader_and_gets_none(stores):
    leader = LeaderPhases(stores(), is_leader=True, heartbeat_store=stores(), heartbeat_s=0.1)
    follower = LeaderPhases(stores(), is_leader=False)
    out: dict = {}
    t = _follow(follower, "eval", out)
    done = threading.Event()
    assert leader.run("eval", lambda: done.wait(1.0) or 42) == 42  # the leader's phase takes 1 s
    t.join(10)
    assert "error" not in out and out["result"] is None and out["waited_s"] >= 0.9
    leader.close()


def test_leader_failure_reaches_the_follower_with_the_phase_name(stores):
    leader = LeaderPhases(stores(), is_leader=True, heartbeat_store=stores(), heartbeat_s=0.1)
    follower = LeaderPhases(stores(), is_leader=False)
    out: dict = {}
    t = _follow(follower, "eval before training", out)
    with pytest.raises(RuntimeError, match="retriever down"):
        leader.run("eval before training", lambda: (_ for _ in ()).throw(RuntimeError("retriever down")))
    t.join(10)
    assert "eval before training" in str(out["error"]) and "retriever down" in str(out["error"])
    leader.close()


def test_a_silent_leader_is_noticed_in_seconds(stores):
    """The leader stops heartbeating (dead or hung process) before publishing the phase's end."""
    leader = LeaderPhases(stores(), is_leader=True, heartbeat_store=stores(), heartbeat_s=0.1)
    leader.close()  # heartbeats stop
    follower = LeaderPhases(stores(), is_leader=False, dead_after_s=1.0)
    out: dict = {}
    _follow(follower, "wait for the batch of step 3", out).join(15)
    assert isinstance(out["error"], LeaderFailed) and "stopped heartbeating" in str(out["error"])
    assert "wait for the batch of step 3" in str(out["error"]) and out["waited_s"] < 5


def test_the_phase_timeout_bounds_the_wait(stores):
    leader = LeaderPhases(stores(), is_leader=True, heartbeat_store=stores(), heartbeat_s=0.1)  # alive, never done
    follower = LeaderPhases(stores(), is_leader=False, margin_s=0.5)
    out: dict = {}
    _follow(follower, "wait for a batch", out, timeout_s=0.5).join(15)
    assert "did not finish its phase 'wait for a batch'" in str(out["error"]) and 0.9 <= out["waited_s"] < 5
    leader.close()
