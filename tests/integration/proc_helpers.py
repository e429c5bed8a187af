"""Shared helpers of the integration tests: free ports, torchrun jobs, leftover-process checks, and the float
tolerances of the parity tests (which must hold on any x86: kernels, thread counts and reduction orders differ)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# float32 parity, relative to max(1, max|reference|): log-probs of a 1000-token vocabulary reach ~10 and entropies
# ~7, so one rounding step (eps 1.2e-7) there is ~1e-6 absolute; measured worst 1.4e-7 of the scale.
SCALED_REL = 1e-5
# a gradient norm sums squares over every parameter in a layout-dependent order: measured worst relative 2e-6
GRAD_NORM_REL = 1e-4
# weights after one Adam step from the same start: the step is ~lr per element whatever the gradient's size, and an
# element whose gradient is near Adam's eps turns float32 rounding of that gradient into up to 2.5e-6 at lr 1e-3
# (measured); lr/20 is still far below the ~lr a wrong gradient direction moves an element.
ADAM_STEP_REL = 0.05


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


def scaled_maxdiff(a, b) -> float:
    """max |x - y| over paired tensors, divided by max(1, max |y|) (compare with ``SCALED_REL``)."""
    pairs = list(zip(a, b, strict=True))
    err = max((x - y).abs().max().item() for x, y in pairs)
    return err / max(1.0, max(y.abs().max().item() for _, y in pairs))


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


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children, grandchildren, ...; sessions do not matter): a job's processes as
    Slurm's cgroup sees them, e.g. torchrun's ranks and their broker and engines."""
    parent = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state
    out, frontier = [], [root]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        out += kids
        frontier = kids
    return out
