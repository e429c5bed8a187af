"""Whole CPU runs (the embedded default under torchrun) that must not end in "success":

- non-finite rewards (a broken reward function) from step 2 on: counted, and after
  ``runner.max_nonfinite_steps`` steps in a row the job exits non-zero naming the key (it ran to exit 0
  before, every step skipped);
- SIGUSR1 (a preemption notice) mid-run: a complete checkpoint of the last finished step, a non-zero exit,
  and a resume from that checkpoint with every step once in metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from proc_helpers import REPO, pids_mentioning, read_metrics, run_job, tiny_cmd, tiny_env


@pytest.mark.slow
def test_nonfinite_rewards_stop_the_run(prepared, tmp_path):
    run_dir = tmp_path / "run"
    r = run_job(prepared, run_dir, "runner.max_steps=8", "runner.max_nonfinite_steps=2",
                'rollout_buffer.sample_filter_path="nan_rewards:nan_from_second_batch"')
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
    return subprocess.Popen(tiny_cmd(prep, run_dir, *extra), cwd=REPO, env=tiny_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGUSR1, signal.SIG_IGN))


def _steps(run_dir: Path) -> list[int]:
    p = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in p.read_text().splitlines() if line.strip()] if p.is_file() else []


@pytest.mark.slow
def test_sigusr1_checkpoints_the_last_step_and_the_run_resumes_from_it(prepared, tmp_path):
    """SIGUSR1 to every process of the job mid-run (as Slurm's ``--signal=USR1@...``): the job writes a complete checkpoint
    of its last finished step (no checkpoint interval set) and exits non-zero; resuming continues from it and
    every step shows once in metrics.jsonl."""
    run_dir = tmp_path / "run"
    job = _start(prepared, run_dir, "runner.max_steps=30", "runner.resume=true")
    try:
        deadline = time.monotonic() + 240
        while not _steps(run_dir) or max(_steps(run_dir)) < 2:
            assert job.poll() is None and time.monotonic() < deadline, "the run did not reach step 2"
            time.sleep(0.2)
        for pid in [job.pid, *pids_mentioning(str(run_dir))]:  # as Slurm signals every process of the step
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        out, _ = job.communicate(timeout=60)
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
    assert "preempted (signal SIGUSR1)" in out

    r = run_job(prepared, run_dir, f"runner.max_steps={last + 2}", "runner.resume=true")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert f"resumed from {d}" in r.stdout + r.stderr
    recs = read_metrics(run_dir)
    assert [x["step"] for x in recs] == list(range(1, last + 3))
    assert recs[-1]["actor/weight_version"] == last + 2
