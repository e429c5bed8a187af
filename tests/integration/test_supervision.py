"""Supervision for real (issue 15): kill and stop the parts of a running CPU-default job and watch it recover or
fail fast, and leave nothing behind.

- chaos: the engine is SIGKILLed once and SIGSTOPped once during a 12-step run; the run finishes, both faults
  count in ``rollout/engine_restarts`` and the broker's accounting holds with nothing dropped.
- the broker is SIGKILLed: actor rank 0 fails within seconds naming the broker; under ``--max-restarts 1``
  torchrun restarts the job, which resumes from its last complete checkpoint and finishes.
- torchrun is SIGKILLed: no process of the job and no port it bound is left after 10 s.
- actor rank 0 is SIGSTOPped: the rollout rank names it after ``cluster.actor_unresponsive_after_s`` and the job ends.

Every fault is triggered on a condition (a step in metrics.jsonl), never after a bare sleep.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
from proc_helpers import TinyJob, assert_nothing_left, cmdline, pids_mentioning, ppid


def _port_bound(port: int) -> bool:
    """True while some socket listens on (or holds) loopback ``port``."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _broker_port(run_dir: Path) -> int:
    return int((run_dir / "broker.address").read_text().strip().rsplit(":", 1)[1])


def _wait_gone(pids, *, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    left = list(pids)
    while left and time.monotonic() < deadline:
        left = [p for p in left if Path(f"/proc/{p}").exists() and "(Z)" not in _stat(p)]
        time.sleep(0.1)
    return left


def _stat(pid: int) -> str:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "(Z)"
    return next((line for line in status.splitlines() if line.startswith("State:")), "")


@pytest.mark.slow
def test_engine_sigkill_and_sigstop_are_recovered(prepared, tmp_path):
    """SIGKILL the engine after step 2 and SIGSTOP its successor after step 7: each is noticed (dead at once,
    hung after ``rollout.unhealthy_after_s``), restarted, re-joined and synced; the run finishes with
    ``rollout/engine_restarts`` = 2, every issued group accounted for, the engine's in-flight groups re-issued
    (not dropped)."""
    # 12 steps: the SIGSTOP lands at step ~5 (7 at most: the restart shows in metrics a step or two after the
    # kill, then 2 more steps), and the buffer (max_buffered_groups 8 = 2 steps of data) cannot finish the run
    # past a stopped engine in the 3+ steps left, so the hang is always noticed before the run ends
    job = TinyJob(
        prepared,
        tmp_path / "run",
        "runner.max_steps=12",
        "rollout.unhealthy_after_s=6",
        "rollout.health_check_timeout_s=2",
    )
    try:
        job.wait_step(2, timeout_s=240)
        first = job.wait_for("the engine's pid", job.engine_pid)
        os.kill(first, signal.SIGKILL)
        t_kill = time.monotonic()
        second = job.wait_for("the restarted engine's pid", lambda: (p := job.engine_pid()) not in (None, first) and p)
        assert time.monotonic() - t_kill < 15, "a dead engine must be noticed and replaced within 15 s"
        rec = job.wait_for(
            "the first restart in metrics",
            lambda: next((r for r in job.records() if r.get("rollout/engine_restarts", 0) >= 1), None),
        )
        job.wait_step(rec["step"] + 2)
        os.kill(second, signal.SIGSTOP)
        t_stop = time.monotonic()
        job.wait_for("the stopped engine to be replaced", lambda: job.engine_pid() not in (None, second), 60)
        assert time.monotonic() - t_stop < 15, "a hung engine must be noticed and replaced within 15 s"
        rc = job.finish(timeout_s=300)
    except BaseException:
        job.kill_all()
        raise
    assert rc == 0, job.output()[-6000:]
    recs = job.records()
    assert recs[-1]["step"] == 12
    last = recs[-1]
    assert last["rollout/engine_restarts"] == 2
    issued = last["broker/issued_groups"]
    assert issued == (
        last["broker/trained_groups"]
        + last["broker/dropped_groups"]
        + last["broker/held_groups"]
        + last["broker/reissued_groups"]
    ), last
    assert last["broker/dropped_groups"] == 0, "groups of the killed engine were dropped instead of re-issued"
    assert last["broker/reissued_groups"] >= 1, "the killed engine's in-flight groups were not re-issued"
    versions = [r["actor/weight_version"] for r in recs]
    assert versions == list(range(1, 13))
    assert _wait_gone(job.leftovers(), timeout_s=10) == []


@pytest.mark.slow
def test_broker_sigkill_fails_fast_and_resumes_under_max_restarts(prepared, tmp_path):
    """SIGKILL the broker after step 4 (a checkpoint every 2 steps): the ranks of that attempt are gone within
    15 s with an error naming the broker; torchrun (``--max-restarts 1``) starts the job again, it resumes from
    the step-4 checkpoint and finishes."""
    run_dir = tmp_path / "run"
    job = TinyJob(
        prepared,
        run_dir,
        "runner.max_steps=7",
        "runner.checkpoint_interval=2",
        'runner.resume="auto"',
        torchrun_args=("--max-restarts", "1"),
    )
    try:
        job.wait_step(4, timeout_s=240)
        ranks = [
            p
            for p in pids_mentioning(str(run_dir))
            if "launch/train.py" in cmdline(p) and p != job.proc.pid and "torch.distributed.run" not in cmdline(p)
        ]
        assert len(ranks) == 2, ranks
        broker = next(p for p in pids_mentioning(str(run_dir)) if "asyncrl.runner.broker_process" in cmdline(p))
        os.kill(broker, signal.SIGKILL)
        t_kill = time.monotonic()
        assert _wait_gone(ranks, timeout_s=15) == [], "the job's ranks outlived the broker by more than 15 s"
        assert time.monotonic() - t_kill < 15
        rc = job.finish(timeout_s=300)
    except BaseException:
        job.kill_all()
        raise
    out = job.output()
    assert f"the broker (pid {broker}) exited with code -9" in out, out[-6000:]
    assert rc == 0, out[-6000:]
    recs = job.records()
    assert recs[-1]["step"] == 7 and recs[-1]["actor/weight_version"] == 7
    assert (run_dir / "checkpoints" / "step_000006" / "complete").is_file()
    assert "resumed from" in out


def _actor_rank_0(broker: int) -> int:
    """Actor rank 0: the broker's parent (it spawned the broker), a rank of launch/train.py."""
    rank0 = ppid(broker)
    assert "launch/train.py" in cmdline(rank0), cmdline(rank0)
    return rank0


def _stop_after_step_2(job: TinyJob, run_dir: Path, pick, *, finish_s: float) -> tuple[int, int, float]:
    """After step 2, SIGSTOP the process ``pick(the broker's pid)`` names and wait for the job to end: that pid, the
    job's exit status and the seconds from the stop to the end (everything of the job is killed on a failure)."""
    try:
        job.wait_step(2, timeout_s=240)
        broker = next(p for p in pids_mentioning(str(run_dir)) if "asyncrl.runner.broker_process" in cmdline(p))
        pid = pick(broker)
        os.kill(pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        rc = job.finish(timeout_s=finish_s)
        return pid, rc, time.monotonic() - t_stop
    except BaseException:
        job.kill_all()
        raise


@pytest.mark.slow
def test_hung_broker_fails_the_job_within_seconds_naming_it(prepared, tmp_path):
    """SIGSTOP the broker after step 2: it is alive but answers nothing, so no request of the actor's fails before
    its own deadline (60 s and more); actor rank 0's ping watch names it as hung after
    ``cluster.broker_unhealthy_after_s`` (5 s here) and fails the job, which leaves no process behind."""
    run_dir = tmp_path / "run"
    job = TinyJob(prepared, run_dir, "runner.max_steps=50", "cluster.broker_unhealthy_after_s=5")
    broker, rc, took = _stop_after_step_2(job, run_dir, lambda broker: broker, finish_s=120)
    out = job.output()
    assert rc != 0, out[-6000:]
    assert f"the broker (pid {broker}) is alive but answered no heartbeat" in out, out[-6000:]
    assert took < 5 + 20, f"a hung broker must end the job within seconds, took {took:.0f} s"
    assert job.records()[-1]["step"] < 50
    assert_nothing_left(run_dir, within_s=10)


def _global_rank_sibling(broker: int, rank: int) -> int:
    """The rank of launch/train.py whose ``RANK`` is ``rank``, a child of the same torchrun agent as actor rank 0."""
    agent = ppid(_actor_rank_0(broker))
    for pid in pids_mentioning("launch/train.py"):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # ended meanwhile (another test's job)
            continue
        if ppid(pid) == agent and f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no rank {rank} under torchrun agent {agent}")


TWO_ACTOR_RANKS = (
    'cluster.component_placement={ actor = "0-1", "rollout,reward" = "2" }',
    "cluster.num_devices_per_node=3",
)


@pytest.mark.slow
@pytest.mark.parametrize("actor_rank", [0, 1])
def test_stopped_actor_rank_fails_the_job_naming_it(prepared, tmp_path, actor_rank):
    """SIGSTOP an actor rank after step 2; nothing it does has a deadline anyone else waits on.
    0: the job's only actor rank; before any watch the workers filled the buffer and the job waited forever.
    1: the second of two actor ranks, while rank 0 and the rollout rank live on; before, rank 0 waited in its next
    collective for ``cluster.actor_collective_timeout_s`` (30 min) while its own heartbeat went on.
    Every rank watches the other actor ranks' heartbeats and fails the job after ``cluster.actor_unresponsive_after_s``
    (5 s here), naming the stopped rank, which it SIGKILLs first (a stopped process cannot act on torchrun's SIGTERM,
    and torchrun would wait out its 30 s shutdown timeout before its own SIGKILL): nothing is left, within seconds."""
    run_dir = tmp_path / "run"
    shape = TWO_ACTOR_RANKS if actor_rank else ()
    job = TinyJob(
        prepared, run_dir, *shape, "runner.max_steps=50", "cluster.actor_unresponsive_after_s=5", nproc=2 + actor_rank
    )
    pick = (lambda broker: _global_rank_sibling(broker, 1)) if actor_rank else _actor_rank_0
    stopped, rc, took = _stop_after_step_2(job, run_dir, pick, finish_s=180)
    assert stopped != job.proc.pid
    out = job.output()
    assert rc != 0, out[-6000:]
    said = f"actor rank {actor_rank} stopped heartbeating"
    assert said in out and "cluster.actor_unresponsive_after_s = 5 s" in out, out[-6000:]
    assert f"(pid {stopped}, state T) and could not act on torchrun's SIGTERM: SIGKILLed it" in out, out[-6000:]
    assert took < 5 + 20, f"a stopped actor rank must end the job within seconds, took {took:.0f} s"
    assert job.records()[-1]["step"] < 50
    assert_nothing_left(run_dir, within_s=15)


@pytest.mark.slow
def test_torchrun_sigkill_leaves_nothing(prepared, tmp_path):
    """SIGKILL the torchrun agent mid-run: within 10 s no rank, broker or engine of the job runs and neither the
    broker's nor the engine's port is bound."""
    run_dir = tmp_path / "run"
    job = TinyJob(prepared, run_dir, "runner.max_steps=50")
    try:
        job.wait_step(1, timeout_s=240)
        job.wait_for("the engine's pid", job.engine_pid)
        ports = [job.engine_port(), _broker_port(run_dir)]
        assert all(_port_bound(p) for p in ports)
        pids = job.leftovers()
        assert len(pids) >= 4, pids  # torchrun, two ranks, the broker, the engine
        os.kill(job.proc.pid, signal.SIGKILL)
        job.proc.wait(timeout=10)
        left = [cmdline(p) for p in _wait_gone([p for p in pids if p != job.proc.pid], timeout_s=10)]
        bound = [p for p in ports if _port_bound(p)]
    finally:
        job.kill_all()
    assert left == [], f"processes of the job left after torchrun was killed: {left}"
    assert bound == [], f"ports still bound: {bound}"
