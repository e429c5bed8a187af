"""The torchrun launcher: dry runs, config errors before any process starts."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "launch/train.py")


def run(args, **kw):
    env = dict(os.environ)
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120, **kw)


def test_dry_run_prints_derived_values():
    r = run([sys.executable, TRAIN, "configs/searchr1.toml", "--dry-run"])
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "max_inflight_groups = 308  # derived" in out
    assert "max_buffered_groups = 1024  # derived" in out
    assert "max_dropped_groups_per_step = 5120  # derived" in out
    assert "rollout_batch_size = 512\n" in out
    # the plan: 16 ranks, actor on 0-7 (node 0), rollout on 8-15 (node 1)
    assert "0     0     actor" in out and "15    1     rollout" in out


def test_dry_run_override_is_applied_and_not_derived():
    r = run([sys.executable, TRAIN, "configs/searchr1.toml", "rollout_buffer.max_buffered_groups=2048", "--dry-run"])
    assert r.returncode == 0, r.stderr
    assert "max_buffered_groups = 2048\n" in r.stdout


def test_bad_config_fails_before_anything_starts(tmp_path):
    r = run([sys.executable, TRAIN, "configs/tiny.toml", "rollout.pause_mode=abort"])
    assert r.returncode == 2
    assert "config error: rollout.pause_mode" in r.stderr


@pytest.mark.slow
def test_torchrun_dry_run_two_processes():
    r = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            TRAIN,
            "configs/tiny.toml",
            "--dry-run",
        ]
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("# plan: 2 ranks") == 1  # printed once, by rank 0
    assert "1     0     rollout  cpu (rank 1)" in r.stdout


@pytest.mark.slow
def test_torchrun_bad_config_exits_nonzero_on_every_rank(tmp_path):
    import socket

    with socket.socket() as sock:  # a free port, not torchrun's default 29500 (other jobs may hold it)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run_dir = tmp_path / "run"
    r = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(port),
            TRAIN,
            "configs/tiny.toml",
            "data.rollout_batch_size=0",
            f'logging.run_dir="{run_dir}"',
        ]
    )
    assert r.returncode != 0
    # Every rank validates before anything starts; the first to exit makes torchrun stop the other,
    # which may be killed before it prints, so at least one report (each report names the key).
    assert r.stderr.count("config error: data.rollout_batch_size") >= 1, r.stderr[-2000:]
    assert not run_dir.exists()  # no rank got as far as making the run directory
    assert "prepare:" not in r.stderr and "broker at" not in r.stderr
