"""Shared helpers of the integration tests: free ports, torchrun jobs, leftover-process checks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A free loopback TCP port from the OS (never a hard-coded one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: Path, args: list[str], *, nproc: int = 2, timeout_s: float = 180) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node N script args`` with the repo importable, one thread per rank."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)


def pids_mentioning(text: str) -> list[int]:
    """PIDs (other than this one) whose command line contains ``text``, e.g. a test's run directory."""
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
