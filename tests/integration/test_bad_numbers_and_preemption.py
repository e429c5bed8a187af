"""Whole CPU runs (the embedded default under torchrun) that must not end in "success":

- non-finite rewards (a broken reward function) from step 2 on: counted, and after
  ``runner.max_nonfinite_steps`` steps in a row the job exits non-zero naming the key (it ran to exit 0
  before, every step skipped);
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_e2e import prepared, read_metrics, run_job  # noqa: F401  (prepared is a fixture)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.mark.slow
def test_nonfinite_rewards_stop_the_run(prepared, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]))
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
