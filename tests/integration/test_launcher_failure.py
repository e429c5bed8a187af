"""One rank fails: the whole torchrun job stops within seconds, shows the error, leaves no processes."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pids_mentioning(text: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            out.append(int(d.name))
    return out


@pytest.mark.slow
def test_rank_failure_stops_job_and_children(tmp_path):
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
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
    while _pids_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _pids_mentioning(str(run_dir)) == []
