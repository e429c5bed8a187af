"""Leader-only phases (``asyncrl.trainer.leader_phases``) over a real TCPStore, the leader and a follower as threads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from asyncrl.trainer.leader_phases import Heartbeat, LeaderFailed, LeaderPhases, beat_key, watch_actor_ranks

WAIT_S = 60.0  # bounds a wait for something that happens at once when the code works, on a loaded host too
START_S = 120.0  # bounds a child's start-up (Python and torch imported, the store joined) on a loaded host
# a watch's dead_after_s where a live rank must not be called dead: far above how long a loaded host may leave a
# heartbeat thread unscheduled, so only a beat that stopped reads as silence
LIVE_DEAD_AFTER_S = 2.0


@pytest.fixture
def stores():
    """A TCPStore server and client connections to it (each ``LeaderPhases`` user gets its own)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), use_libuv=True)
    opened = []

    def client():
        s = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30), use_libuv=True)
        opened.append(s)
        return dist.PrefixStore("run/", s)

    client.port = server.port  # for a process of its own
    yield client
    opened.clear()  # clients first, then the server goes with the fixture's frame


@pytest.fixture
def own(stores):
    """``own(x)`` -> x, closed (phases) or stopped (watches) at the test's end, before its stores go: a thread of
    theirs left inside a store call when pytest exits would abort it (see ``ActorWatch.stop``)."""
    owned: list = []
    yield lambda x: owned.append(x) or x
    for x in reversed(owned):
        x.stop() if hasattr(x, "stop") else x.close()


def _follow(follower: LeaderPhases, name: str, out: dict, timeout_s=None) -> threading.Thread:
    """The follower's ``run`` on a thread: ``out`` gets ``started`` (set as it begins), ``result`` or ``error``,
    ``waited_s`` and ``ended_at`` (monotonic)."""
    out["started"] = threading.Event()

    def body():
        t0 = time.monotonic()
        out["started"].set()
        try:
            out["result"] = follower.run(
                name, lambda: pytest.fail("a follower must not run the phase"), timeout_s=timeout_s
            )
        except LeaderFailed as e:
            out["error"] = e
        out["ended_at"] = time.monotonic()
        out["waited_s"] = out["ended_at"] - t0

    t = threading.Thread(target=body)
    t.start()
    return t


def _join(t: threading.Thread) -> None:
    t.join(WAIT_S)
    assert not t.is_alive(), f"the follower did not return within {WAIT_S:g} s"


def test_follower_waits_for_the_leader_and_gets_none(stores, own):
    leader = own(LeaderPhases(stores(), rank=0, heartbeat_store=stores(), heartbeat_s=0.1))
    follower = own(LeaderPhases(stores(), rank=1, heartbeat_store=stores()))
    out: dict = {}
    t = _follow(follower, "eval", out)
    phase: dict = {}

    def work() -> int:  # the leader's phase ends only once the follower is in its wait
        assert out["started"].wait(WAIT_S), "the follower never started"
        phase["follower_still_waiting"] = t.is_alive() and "result" not in out and "error" not in out
        phase["ended_at"] = time.monotonic()
        return 42

    assert leader.run("eval", work) == 42
    _join(t)
    assert "error" not in out and out["result"] is None
    assert phase["follower_still_waiting"] and out["ended_at"] >= phase["ended_at"]  # it returned after the phase
    leader.close()


def test_leader_failure_reaches_the_follower_with_the_phase_name(stores, own):
    leader = own(LeaderPhases(stores(), rank=0, heartbeat_store=stores(), heartbeat_s=0.1))
    follower = own(LeaderPhases(stores(), rank=1, heartbeat_store=stores()))
    out: dict = {}
    t = _follow(follower, "eval before training", out)
    with pytest.raises(RuntimeError, match="retriever down"):
        leader.run("eval before training", lambda: (_ for _ in ()).throw(RuntimeError("retriever down")))
    _join(t)
    assert "eval before training" in str(out["error"]) and "retriever down" in str(out["error"])
    leader.close()


def test_a_silent_leader_is_noticed_in_seconds(stores, own):
    """The leader stops heartbeating (dead or hung process) before publishing the phase's end."""
    leader = own(LeaderPhases(stores(), rank=0, heartbeat_store=stores(), heartbeat_s=0.1))
    leader.close()  # heartbeats stop
    follower = own(LeaderPhases(stores(), rank=1, heartbeat_store=stores(), dead_after_s=1.0))
    out: dict = {}
    _join(_follow(follower, "wait for the batch of step 3", out))
    assert isinstance(out["error"], LeaderFailed) and "stopped heartbeating" in str(out["error"])
    # its own 1 s, not the default 30 s: noticed in seconds (bounded well below 30 s for a loaded host)
    assert "wait for the batch of step 3" in str(out["error"]) and 1.0 <= out["waited_s"] < 15


def test_the_phase_timeout_bounds_the_wait(stores, own):
    leader = own(LeaderPhases(stores(), rank=0, heartbeat_store=stores(), heartbeat_s=0.1))  # alive, never done
    follower = own(LeaderPhases(stores(), rank=1, heartbeat_store=stores(), margin_s=0.5))
    out: dict = {}
    _join(_follow(follower, "wait for a batch", out, timeout_s=0.5))
    # 0.5 s + its 0.5 s margin, not the default 60 s margin (bounded well below it for a loaded host)
    assert "did not finish its phase 'wait for a batch'" in str(out["error"]) and 1.0 <= out["waited_s"] < 30
    leader.close()


# ------------------------------------------------------------------ every rank's watch (``watch_actor_ranks``)
def test_heartbeat_arms_at_the_first_beat_and_counts_silence_from_the_last_change():
    hb = Heartbeat(5.0, now=0.0, armed=False)
    assert hb.observe(0, 0.0) is None and hb.observe(0, 100.0) is None  # start-up: no beat yet, never dead
    assert hb.observe(1, 101.0) is None  # the first beat arms it
    assert hb.observe(1, 105.5) is None  # 4.5 s of silence
    assert hb.observe(2, 106.0) is None  # a new beat resets the clock
    assert hb.observe(2, 110.0) is None and hb.observe(2, 111.5) == pytest.approx(5.5)
    armed = Heartbeat(1.0, now=0.0)  # a phase wait: the leader has been beating, so silence counts at once
    assert armed.observe(7, 0.0) is None and armed.observe(7, 1.5) == pytest.approx(1.5)


def test_watch_names_a_leader_whose_beat_stops(stores, own):
    beat, dead = stores(), threading.Event()
    said: list[str] = []
    for _ in range(3):  # actor rank 0 beat, then stopped (SIGSTOP: its thread is frozen, nothing marks it done)
        beat.add(beat_key(0), 1)
    t0 = time.monotonic()
    own(
        watch_actor_ranks(
            stores(), ranks=[0], dead_after_s=1.0, poll_s=0.05, on_dead=lambda m: (said.append(m), dead.set())
        )
    )
    assert dead.wait(WAIT_S), "the watch did not notice a silent leader"
    assert 1.0 <= time.monotonic() - t0 < 15  # in seconds (bounded loosely for a loaded host)
    assert "actor rank 0 stopped heartbeating" in said[0] and "cluster.actor_unresponsive_after_s = 1 s" in said[0]


def _beating(reader, rank: int, at_least: int = 5, within_s: float = START_S) -> None:
    """Wait until actor rank ``rank`` has beaten ``at_least`` times (a watch is armed for it)."""
    deadline = time.monotonic() + within_s
    while (beats := reader.add(beat_key(rank), 0)) < at_least:
        assert time.monotonic() < deadline, f"actor rank {rank} beat {beats} times in {within_s:g} s, not {at_least}"
        time.sleep(0.02)


def test_watch_stands_down_when_the_leader_closes(stores, own):
    leader = own(LeaderPhases(stores(), rank=0, heartbeat_store=stores(), heartbeat_s=0.05))
    said: list[str] = []
    reader = stores()
    t = own(watch_actor_ranks(stores(), ranks=[0], dead_after_s=LIVE_DEAD_AFTER_S, poll_s=0.05, on_dead=said.append))
    _beating(reader, 0)
    leader.close()  # the run ended: the beat stops on purpose
    t.thread.join(WAIT_S)
    assert not t.thread.is_alive() and said == []


def test_watch_names_a_follower_rank_whose_beat_stops_while_the_leader_beats_on(stores, own):
    """Actor rank 1 stops (SIGSTOP freezes its heartbeat thread; here: its beat stops without ``close``) while rank 0
    lives: rank 0 would wait in its next collective for the collective timeout; the watch names rank 1."""
    leader = own(LeaderPhases(stores(), rank=0, heartbeat_store=stores(), heartbeat_s=0.05))
    follower = own(LeaderPhases(stores(), rank=1, heartbeat_store=stores(), heartbeat_s=0.05))
    said, dead = [], threading.Event()
    own(
        watch_actor_ranks(
            stores(),
            ranks=[0, 1],
            dead_after_s=LIVE_DEAD_AFTER_S,
            poll_s=0.05,
            on_dead=lambda m: (said.append(m), dead.set()),
        )
    )
    _beating(stores(), 1)
    follower._stop.set()  # frozen, not closed: nothing marks it done
    assert dead.wait(WAIT_S), "the watch did not notice a silent follower"
    assert said[0].startswith("actor rank 1 stopped heartbeating")
    leader.close()


def test_watch_lets_a_follower_close_before_the_leader(stores, own):
    """A follower that ends first (its phases closed) is no longer watched; the leader still is, until it closes."""
    leader = own(LeaderPhases(stores(), rank=0, heartbeat_store=stores(), heartbeat_s=0.05))
    follower = own(LeaderPhases(stores(), rank=1, heartbeat_store=stores(), heartbeat_s=0.05))
    said: list[str] = []
    t = own(watch_actor_ranks(stores(), ranks=[0, 1], dead_after_s=LIVE_DEAD_AFTER_S, poll_s=0.05, on_dead=said.append))
    reader = stores()
    _beating(reader, 0)
    _beating(reader, 1)
    follower.close()
    # the leader beats on, every 0.05 s at the most: so many beats take at least twice dead_after_s
    quiet_until = reader.add(beat_key(0), 0) + int(2 * LIVE_DEAD_AFTER_S / 0.05)
    _beating(reader, 0, at_least=quiet_until)
    assert said == [] and t.thread.is_alive()
    leader.close()
    t.thread.join(WAIT_S)
    assert not t.thread.is_alive() and said == []


_EXIT_WITH_A_WATCH = """
import sys
from datetime import timedelta
import torch.distributed as dist
from asyncrl.trainer.leader_phases import beat_key, watch_actor_ranks
server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), use_libuv=True)
client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30), use_libuv=True)
client.add(beat_key(0), 1)
watch = watch_actor_ranks(client, ranks=[0], dead_after_s=600, poll_s=0, on_dead=print)  # always inside a store call
for _ in range(2000):  # the watch has read the store many times over
    if client.add("probe", 1) and not watch.thread.is_alive():
        sys.exit("the watch ended early")
if sys.argv[1] == "stop":
    assert watch.stop(), "the watch did not stop"
sys.exit(0)
"""


def test_a_process_that_stops_its_watch_exits_cleanly():
    """A rank whose run succeeded exits 0: with its watch stopped first, no thread is inside a store call when Python
    finalizes (one that is gets ``pthread_exit``, which aborts in torch's C++ frames: SIGABRT, exit -6 in CI)."""
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", _EXIT_WITH_A_WATCH, "stop"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "terminate called" not in done.stderr


_RANK_1 = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from asyncrl.trainer.leader_phases import LeaderPhases
def client():
    s = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=30), use_libuv=True)
    return dist.PrefixStore("run/", s)
phases = LeaderPhases(client(), rank=1, heartbeat_store=client(), heartbeat_s=0.05)
time.sleep(120)
"""


def test_a_stopped_rank_of_this_host_is_killed_by_the_watch_that_names_it(stores, own):
    """A real actor-rank process beats, then is SIGSTOPped: the watch names it AND SIGKILLs it (it cannot act on
    torchrun's SIGTERM), instead of leaving it for torchrun's 30 s shutdown timeout."""
    reader = stores()
    rank1 = subprocess.Popen([sys.executable, "-c", _RANK_1, str(stores.port)])
    try:
        _beating(reader, 1)
        said, dead = [], threading.Event()
        own(
            watch_actor_ranks(
                stores(),
                ranks=[1],
                dead_after_s=LIVE_DEAD_AFTER_S,
                poll_s=0.05,
                on_dead=lambda m: (said.append(m), dead.set()),
            )
        )
        os.kill(rank1.pid, signal.SIGSTOP)
        assert dead.wait(WAIT_S), "the watch did not notice the stopped rank"
        assert rank1.wait(WAIT_S) == -signal.SIGKILL
        assert said[0].startswith("actor rank 1 stopped heartbeating") and f"(pid {rank1.pid}, state T)" in said[0]
        assert "SIGKILLed it" in said[0]
    finally:
        if rank1.poll() is None:
            rank1.kill()
            rank1.wait(10)
