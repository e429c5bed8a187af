"""The CPU engine's two processes (HTTP + scheduler, as SGLang's), each failure made for real: the scheduler process
SIGKILLed takes the engine down with status 1 (named in its log); the engine SIGKILLed takes its scheduler process
along; SIGTERM stops both with status 0; a model that cannot load exits 1 naming why, before the port answers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from proc_helpers import alive, free_port, ppid, wait_for

from asyncrl.models.tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and ppid(int(p)) == pid]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture
def engine(tmp_path):
    """A CPU engine process on a fresh port, up and answering; (popen, url, log path). Killed at the end."""
    model = make_tiny_checkpoint(
        tmp_path / "model", arch="qwen2", seed=0, num_hidden_layers=1, hidden_size=32, intermediate_size=64
    )
    port = free_port()
    log = tmp_path / "engine.log"
    with open(log, "wb") as f:
        p = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.cpu_engine.server", "--model-path", str(model), "--port", str(port)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _healthy(url) or p.poll() is not None, "the engine to answer /health", timeout_s=120)
        assert p.poll() is None, log.read_text()[-2000:]
        yield p, url, log
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)


def test_engine_runs_as_two_processes_and_a_dead_scheduler_process_exits_it_with_status_1(engine):
    p, url, log = engine
    (sched,) = _children(p.pid)
    os.kill(sched, signal.SIGKILL)
    t0 = time.monotonic()
    assert p.wait(timeout=30) == 1
    assert time.monotonic() - t0 < 10, "a dead scheduler process must be noticed in seconds"
    assert f"the scheduler process {sched} exited with status -9" in log.read_text()


def test_sigkilled_engine_takes_its_scheduler_process_along(engine):
    p, url, log = engine
    (sched,) = _children(p.pid)
    os.kill(p.pid, signal.SIGKILL)  # the engine alone, not its process group
    p.wait(timeout=30)
    wait_for(lambda: not alive(sched), "the scheduler process to die with the engine", timeout_s=10)


def test_sigterm_stops_both_processes_with_status_0(engine):
    p, url, log = engine
    (sched,) = _children(p.pid)
    os.killpg(p.pid, signal.SIGTERM)  # as the launcher stops an engine: its whole process group
    assert p.wait(timeout=30) == 0, log.read_text()[-2000:]
    wait_for(lambda: not alive(sched), "the scheduler process to stop", timeout_s=10)


def test_model_that_fails_to_load_exits_1_naming_why_before_the_port_answers(tmp_path):
    model = make_tiny_checkpoint(
        tmp_path / "model", arch="qwen2", seed=0, num_hidden_layers=1, hidden_size=32, intermediate_size=64
    )
    for f in model.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    port = free_port()
    r = subprocess.run(
        [sys.executable, "-m", "asyncrl.cpu_engine.server", "--model-path", str(model), "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 1
    assert "the scheduler process failed to start" in r.stderr
    assert "ready to roll" not in r.stderr
