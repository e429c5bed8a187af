"""Whole CPU runs (the embedded default under torchrun) that must not end in "success":

- non-finite rewards (a broken reward function) from step 2 on: counted, and after
  ``runner.max_nonfinite_steps`` steps in a row the job exits non-zero naming the key (it ran to exit 0
  before, every step skipped);
- SIGUSR1 (a preemption notice) mid-run: a complete checkpoint of the last finished step, a non-zero exit,
  and a resume from that checkpoint with every step once in metrics.jsonl.
"""

from __future__ import annotations

import os
import signal

import pytest
from proc_helpers import TinyJob, pids_mentioning, read_metrics, run_tiny


@pytest.mark.slow
def test_nonfinite_rewards_stop_the_run(prepared, tmp_path):
    run_dir = tmp_path / "run"
    r = run_tiny(prepared, run_dir, "runner.max_steps=8", "runner.max_nonfinite_steps=2",
                 'rollout_buffer.sample_filter_path="nan_rewards:nan_from_second_batch"')
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-4000:]
    assert "runner.max_nonfinite_steps = 2" in out, out[-4000:]
    recs = read_metrics(run_dir)
    assert [x["step"] for x in recs] == [1, 2, 3]
    assert recs[0]["train/nonfinite_steps"] == 0 and recs[0]["rollout/nonfinite_rewards"] == 0
    assert recs[-1]["train/nonfinite_steps"] == 2 and recs[-1]["rollout/nonfinite_rewards"] > 0


@pytest.mark.slow
def test_sigusr1_checkpoints_the_last_step_and_the_run_resumes_from_it(prepared, tmp_path):
    """SIGUSR1 to every process of the job mid-run (as Slurm's ``--signal=USR1@...``): the job writes a complete checkpoint
    of its last finished step (no checkpoint interval set) and exits non-zero; resuming continues from it and
    every step shows once in metrics.jsonl."""
    run_dir = tmp_path / "run"
    # torchrun itself would die of SIGUSR1: it is started ignoring it (``trap '' USR1; exec torchrun ...`` in a
    # Slurm script); the ranks inherit that, and the actor ranks' step loop handles it
    job = TinyJob(prepared, run_dir, "runner.max_steps=30", "runner.resume=true",
                  preexec_fn=lambda: signal.signal(signal.SIGUSR1, signal.SIG_IGN))
    try:
        job.wait_step(2, timeout_s=240)
        for pid in [job.proc.pid, *pids_mentioning(str(run_dir))]:  # as Slurm signals every process of the step
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        rc = job.finish(timeout_s=60)
    except BaseException:
        job.kill_all()
        raise
    out = job.output()
    assert rc != 0, out[-4000:]
    last = max(x["step"] for x in read_metrics(run_dir))
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*") if (p / "complete").is_file())
    assert ckpts == [f"step_{last:06d}"], (ckpts, last, out[-4000:])
    d = run_dir / "checkpoints" / ckpts[0]
    assert (d / "broker_state.bin").is_file() and (d / "run.json").is_file()
    assert "preempted (signal SIGUSR1)" in out

    r = run_tiny(prepared, run_dir, f"runner.max_steps={last + 2}", "runner.resume=true")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert f"resumed from {d}" in r.stdout + r.stderr
    recs = read_metrics(run_dir)
    assert [x["step"] for x in recs] == list(range(1, last + 3))
    assert recs[-1]["actor/weight_version"] == last + 2
