"""Supervision with real processes: a CPU engine stopped (SIGSTOP) is called hung by its probes and relaunched;
a vital child's death fails its parent at once; a process whose parent is SIGKILLed takes its children along."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from proc_helpers import alive, pids_mentioning, ppid, wait_for

from asyncrl.cpu_engine.testing import running_cpu_engine
from asyncrl.engine.launch import EngineLaunchError
from asyncrl.engine.liveness import HealthTracker
from asyncrl.models.tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _post(url: str, path: str, body: bytes = b"{}") -> int:
    req = urllib.request.Request(url + path, data=body, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status


def test_stopped_engine_is_called_hung_and_relaunched(tmp_path):
    model = make_tiny_checkpoint(
        tmp_path / "model", arch="qwen2", seed=0, num_hidden_layers=1, hidden_size=32, intermediate_size=64
    )
    with running_cpu_engine(model, log_dir=tmp_path / "logs") as sup:
        sup.max_restarts = 1
        assert sup.probe(timeout_s=5)
        _post(sup.url, "/pause_generation", b'{"mode": "retract"}')
        assert sup.probe(timeout_s=5), "/health must answer while generation is paused (a weight sync)"
        _post(sup.url, "/continue_generation")
        first = sup.pid
        os.kill(first, signal.SIGSTOP)
        tracker = HealthTracker(unhealthy_after_s=2.0)
        t0 = time.monotonic()
        verdict = None
        while verdict is None:
            t = time.monotonic()
            verdict = tracker.observe(alive=sup.alive(), ok=sup.probe(timeout_s=0.5), t=t, exit_code=sup.exit_code())
            assert time.monotonic() - t0 < 10, "a stopped engine was not called hung"
        assert verdict.startswith("hung")
        sup.relaunch(verdict)
        sup.wait_ready()
        assert sup.pid != first and sup.restarts == 1 and sup.probe(timeout_s=5)
        assert not Path(f"/proc/{first}").exists() or "zombie" in Path(f"/proc/{first}/status").read_text()
        os.kill(sup.pid, signal.SIGKILL)
        wait_for(lambda: not sup.alive(), "the killed engine to be seen dead")
        with pytest.raises(
            EngineLaunchError,
            match=r"cpu_engine_\d+ at http.* after 1 restart\(s\) "
            r"\(rollout.max_restarts=1\)",
        ):
            sup.relaunch("dead: the process exited with code -9")


_CHILD_DIES = textwrap.dedent("""
    import sys, time
    from asyncrl.cluster import process
    child = process.spawn_child("vital", [sys.executable, "-c", "import time; time.sleep(0.5)"], log_dir=sys.argv[1])
    process.fail_fast_on_exit(child, what="the vital child")
    time.sleep(60)
""")

_PARENT_DIES = textwrap.dedent("""
    import subprocess, sys, time
    rank = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1]], start_new_session=True)
    print(rank.pid, flush=True)
    time.sleep(600)
""")

_PARENT_DIES_WITH_THE_PIPES = textwrap.dedent("""
    import subprocess, sys, time
    rank = subprocess.Popen(
        [sys.executable, "-c", sys.argv[2], sys.argv[1]], start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,  # only this process reads the rank's console
    )
    print(rank.pid, flush=True)
    time.sleep(600)
""")

_RANK = textwrap.dedent("""
    import sys, time
    from asyncrl.cluster import process
    process.start_parent_watchdog(grace_s=5)
    process.spawn_child("engine", [sys.executable, "-c", "import time; time.sleep(600)"], log_dir=sys.argv[1])
    time.sleep(600)
""")


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def test_vital_child_death_fails_the_parent_fast(tmp_path):
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-c", _CHILD_DIES, str(tmp_path)], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1
    assert "the vital child (pid" in r.stderr and "exited with code 0" in r.stderr
    assert time.monotonic() - t0 < 30  # not the 60 s sleep


@pytest.mark.parametrize("agent", [_PARENT_DIES, _PARENT_DIES_WITH_THE_PIPES], ids=["console", "piped"])
def test_sigkilled_parent_takes_the_rank_and_its_children(tmp_path, agent):
    """The shape of torchrun: the agent starts a rank in its own session; SIGKILL the agent and the rank (which
    watches its parent) stops its child and exits. ``piped``: the rank's stdout/stderr are pipes only the agent
    read, so the rank's last words hit a closed pipe (once that killed the watchdog thread: the rank lived on)."""
    agent = subprocess.Popen(
        [sys.executable, "-c", agent, str(tmp_path), _RANK], env=_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        rank = int(agent.stdout.readline())
        engine = wait_for(
            lambda: next((p for p in pids_mentioning("time.sleep(600)") if ppid(p) == rank), None), "the rank's child"
        )
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(timeout=10)
        wait_for(lambda: not alive(rank) and not alive(engine), "the rank and its child to exit", timeout_s=10)
    finally:
        for p in pids_mentioning(str(tmp_path)):
            os.kill(p, signal.SIGKILL)
        agent.kill()


def test_engine_helper_starts_again_when_its_port_was_taken_before_the_engine_bound_it(tmp_path, monkeypatch):
    """The port the OS handed out is taken (a real listening socket) before the engine binds it: the engine exits
    with 'address already in use', and ``running_cpu_engine`` starts it again on a fresh port."""
    import socket

    from asyncrl.cpu_engine import testing

    model = make_tiny_checkpoint(
        tmp_path / "model", arch="qwen2", seed=0, num_hidden_layers=1, hidden_size=32, intermediate_size=64
    )
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        ports = iter([taken])
        real = testing.free_port
        monkeypatch.setattr(testing, "free_port", lambda: next(ports, None) or real())
        with running_cpu_engine(model, log_dir=tmp_path / "logs", max_running_requests=2) as sup:
            assert sup.url != f"http://127.0.0.1:{taken}"
            with urllib.request.urlopen(sup.url + "/model_info", timeout=30) as r:
                assert r.status == 200
    log = (tmp_path / "logs" / f"cpu_engine_{taken}.log").read_text()
    assert f"cannot listen on 127.0.0.1:{taken}" in log and "Address already in use" in log
    assert "fired up" not in log  # ready is only logged once the port is the engine's
