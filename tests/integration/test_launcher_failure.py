"""One rank fails: the whole torchrun job stops within seconds, shows the error, leaves no processes."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_helpers import free_port, pids_mentioning

ROOT = Path(__file__).resolve().parents[2]




@pytest.mark.slow
def test_rank_failure_stops_job_and_children(tmp_path):
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(ROOT / "launch/train.py"), "configs/tiny.toml", "prepare.enabled=false",
           f'rollout.model_path="{tmp_path}/no_such_model"', f'logging.run_dir="{run_dir}"']
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0
    assert "rollout.model_path" in r.stderr and "no_such_model" in r.stderr
    assert elapsed < 60, f"job took {elapsed:.0f}s to stop"
    # actor rank 0 had started the broker child (its log exists); nothing of this run is left
    assert (run_dir / "logs" / "broker.log").exists()
    deadline = time.monotonic() + 10
    while pids_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pids_mentioning(str(run_dir)) == []
