"""Whole CPU runs (the embedded default under torchrun) that must not end in "success":

- non-finite rewards (a broken reward function) from step 2 on: counted, and after
  ``runner.max_nonfinite_steps`` steps in a row the job exits non-zero naming the key (it ran to exit 0
  before, every step skipped);
- SIGUSR1 (Slurm's preemption notice) or SIGTERM (Slurm's time limit, ``scancel``) to every process of the job
  mid-run: a complete checkpoint of the last finished step, a non-zero exit (the actor rank's 75), and a resume
  from that checkpoint with every step once in metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from proc_helpers import REPO, descendants, read_metrics, run_job, tiny_cmd, tiny_env

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.mark.slow
def test_nonfinite_rewards_stop_the_run(prepared, tmp_path):
    run_dir = tmp_path / "run"
    r = run_job(
        prepared,
        run_dir,
        "runner.max_steps=8",
        "runner.max_nonfinite_steps=2",
        'rollout_buffer.sample_filter_path="nan_rewards:nan_from_second_batch"',
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-4000:]
    assert "runner.max_nonfinite_steps = 2" in out, out[-4000:]
    recs = read_metrics(run_dir)
    assert [x["step"] for x in recs] == [1, 2, 3]
    assert recs[0]["train/nonfinite_steps"] == 0 and recs[0]["rollout/nonfinite_rewards"] == 0
    assert recs[-1]["train/nonfinite_steps"] == 2 and recs[-1]["rollout/nonfinite_rewards"] > 0


def _start(prep: Path, run_dir: Path, *extra: str) -> subprocess.Popen:
    # torchrun itself would die of SIGUSR1: it is started ignoring it (``trap '' USR1; exec torchrun ...`` in a
    # Slurm script); the ranks inherit that, and the actor ranks' step loop handles it
    return subprocess.Popen(
        tiny_cmd(prep, run_dir, *extra),
        cwd=REPO,
        env=tiny_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGUSR1, signal.SIG_IGN),
    )


def _steps(run_dir: Path) -> list[int]:
    p = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in p.read_text().splitlines() if line.strip()] if p.is_file() else []


# torch 2.13's torchrun on SIGTERM sends SIGTERM to its workers and SIGKILLs them after ``--shutdown-timeout``
# (default 30 s, ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``): the checkpoint must be written within that
TORCHRUN_SHUTDOWN_TIMEOUT_S = 30


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=["SIGTERM"])
def test_preemption_signal_checkpoints_the_last_step_and_the_run_resumes_from_it(prepared, tmp_path, sig):
    """``sig`` to every process of the job mid-run, torchrun included, as Slurm sends SIGTERM at the time limit or
    on ``scancel``: the job writes a complete checkpoint of its last trained step (no checkpoint interval set; with
    the broker's buffered groups) and exits non-zero, the actor rank with 75; resuming continues from it and every
    step shows once in metrics.jsonl. Under SIGTERM the broker defers the signal until actor rank 0 checkpointed,
    torchrun never has to SIGKILL a rank, and nothing of the job is left. Slurm's ``--signal=USR1@...`` notice
    (SIGUSR1) takes the same path; a real Slurm sends it in ``test_slurm_real.py`` (the job checkpoints, requeues
    itself and resumes), so it is not run twice here."""
    run_dir = tmp_path / "run"
    job = _start(prepared, run_dir, "runner.max_steps=30", 'runner.resume="auto"')
    try:
        deadline = time.monotonic() + 240
        while not _steps(run_dir) or max(_steps(run_dir)) < 2:
            assert job.poll() is None and time.monotonic() < deadline, "the run did not reach step 2"
            time.sleep(0.2)
        pids = [job.pid, *descendants(job.pid)]  # torchrun, the ranks, the broker, the engine
        assert len(pids) >= 5, pids
        t_signal = time.monotonic()
        for pid in pids:  # as Slurm signals every process of the step (its cgroup, whatever the sessions)
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        out, _ = job.communicate(timeout=120)
        exit_s = time.monotonic() - t_signal
        (tmp_path / "job.out").write_text(out)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode != 0, out[-4000:]
    last = max(_steps(run_dir))
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*") if (p / "complete").is_file())
    assert ckpts == [f"step_{last:06d}"], (ckpts, last, out[-4000:])
    d = run_dir / "checkpoints" / ckpts[0]
    assert (d / "broker_state.bin").is_file() and (d / "run.json").is_file()
    assert f"preempted (signal {sig.name}) after step {last}" in out and "exit 75" in out, out[-4000:]
    if sig == signal.SIGTERM:
        print(f"SIGTERM to the job's exit: {exit_s:.1f} s")
        assert "forcefully exiting via SIGKILL" not in out, out[-4000:]  # torchrun's words when its grace ran out
        assert exit_s < TORCHRUN_SHUTDOWN_TIMEOUT_S, exit_s
        assert "SIGTERM deferred" in (run_dir / "logs" / "broker.log").read_text()
        deadline = time.monotonic() + 10
        while [p for p in pids if _alive(p)]:
            assert time.monotonic() < deadline, f"left after the job: {[p for p in pids if _alive(p)]}"
            time.sleep(0.1)

    r = run_job(prepared, run_dir, f"runner.max_steps={last + 2}", "runner.resume=true")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert f"resumed from {d}" in r.stdout + r.stderr
    recs = read_metrics(run_dir)
    assert [x["step"] for x in recs] == list(range(1, last + 3))
    assert recs[-1]["actor/weight_version"] == last + 2


@pytest.mark.slow
def test_sigterm_during_a_step_checkpoints_that_step_without_its_sync(prepared, tmp_path, monkeypatch):
    """SIGTERM reaches actor rank 0 (and, through torchrun, every rank) after it took step 3's batch: the step is
    trained and logged, its weight sync is skipped (the engines are stopping), its checkpoint written; the resumed
    run brings the engines to those weights and goes on with every step once."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("ASYNCRL_TEST_SIGTERM_MARK", str(tmp_path / "sigterm.fired"))
    run_dir = tmp_path / "run"
    hook = 'rollout_buffer.sample_filter_path="preempt_hooks:sigterm_on_third_batch"'
    job = _start(prepared, run_dir, "runner.max_steps=6", 'runner.resume="auto"', hook)
    try:
        out, _ = job.communicate(timeout=400)
        (tmp_path / "job.out").write_text(out)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode != 0, out[-4000:]
    assert "preempted (signal SIGTERM) after step 3" in out and "exit 75" in out, out[-4000:]
    recs = read_metrics(run_dir)
    assert [x["step"] for x in recs] == [1, 2, 3]
    assert recs[-1]["time/sync_weights"] == 0.0 and recs[1]["time/sync_weights"] > 0
    assert (run_dir / "checkpoints" / "step_000003" / "complete").is_file()

    r = run_job(prepared, run_dir, "runner.max_steps=5", "runner.resume=true", hook)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    recs = read_metrics(run_dir)
    assert [x["step"] for x in recs] == [1, 2, 3, 4, 5]
    assert recs[-1]["actor/weight_version"] == 5


def _alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]) != "Z"
    except (FileNotFoundError, IndexError):
        return False
