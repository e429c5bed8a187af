"""The CPU engine's stop, for real and many times (issue 41 item 5): SIGTERM or SIGINT with ``/generate`` calls in
flight, the way a launcher, Slurm's ``scancel`` (every process of the job at once, then the rank's own SIGTERM to its
children) and a user's Ctrl-C send them. Each stop must exit 0 within the launcher's grace period, answer every call
in flight (finished, or aborted with SGLang's abort answer), leave no scheduler process behind and log no traceback.
Before the fix a second SIGTERM logged aiohttp ``InvalidStateError`` tracebacks and hung the exit until SIGKILL, and
one SIGTERM with many calls in flight took 10 s (a deadlock with the scheduler process)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from proc_helpers import alive, descendants, free_port, wait_for

from asyncrl.models.tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

GRACE_S = 5.0  # the tests' launcher grace (cpu_engine.testing); the default cluster.shutdown_grace_s is 10
IN_FLIGHT = 32  # many answers at once: the old stop deadlocked with a scheduler process blocked sending them
MAX_NEW = 1500  # long enough to be running at the signal; the engine drains 2 s, then aborts the rest
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("stop") / "model",
        arch="qwen2",
        seed=0,
        num_hidden_layers=2,
        hidden_size=128,
        intermediate_size=256,
    )


def _engine_cmd(model: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "asyncrl.cpu_engine.server", "--model-path", str(model), "--port", str(port)]


def _generate(port: int, k: int) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        body = {"text": f"stop {k}", "sampling_params": {"max_new_tokens": MAX_NEW, "ignore_eos": True}}
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _running(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return any(
        line.startswith("sglang:num_running_reqs") and float(line.rsplit(" ", 1)[1]) > 0 for line in text.splitlines()
    )


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def _log_has(log: Path, text: str) -> bool:
    return text in log.read_text(errors="replace")


def _stop_once(model: Path, tmp: Path, how: str) -> None:
    """Start an engine, put ``IN_FLIGHT`` calls in flight, stop it ``how``; assert the stop's contract."""
    port = free_port()
    log = tmp / f"engine-{how}-{port}.log"
    with open(log, "wb") as f:
        p = subprocess.Popen(
            _engine_cmd(model, port), stdout=f, stderr=subprocess.STDOUT, env=ENV, start_new_session=True
        )
    try:
        wait_for(lambda: _log_has(log, "ready to roll") or p.poll() is not None, f"{log} to be ready", 120)
        sched = descendants(p.pid)
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            calls = [pool.submit(_generate, port, k) for k in range(IN_FLIGHT)]
            wait_for(lambda: _running(port), "the calls to be running", 60)
            t0 = time.monotonic()
            if how == "group":  # a launcher's stop_child: the engine's process group
                os.killpg(p.pid, signal.SIGTERM)
            elif how == "engine":  # the HTTP process alone
                os.kill(p.pid, signal.SIGTERM)
            elif how == "twice":  # scancel signals every process, then the rank's stop_all signals its children
                os.killpg(p.pid, signal.SIGTERM)
                wait_for(lambda: _refused(port), "the stop to begin (its port closed)", GRACE_S)
                os.killpg(p.pid, signal.SIGTERM)
            else:  # Ctrl-C in a terminal
                os.killpg(p.pid, signal.SIGINT)
            code = p.wait(timeout=GRACE_S)
            took = time.monotonic() - t0
            answers = [c.result(timeout=10) for c in calls]
        text = log.read_text(errors="replace")
        assert code == 0, f"{how}: exit {code}\n{text[-3000:]}"
        assert took < GRACE_S, f"{how}: {took:.1f} s"
        for bad in ("Traceback", "ERROR", "InvalidStateError", "Unhandled"):
            assert bad not in text, f"{how}: {bad!r} in {log}:\n{text[-3000:]}"
        for status, body in answers:  # every call in flight answered: finished, or aborted as SGLang answers it
            assert status == 200, (how, status, body)
            assert body["meta_info"]["finish_reason"]["type"] in ("length", "abort"), body["meta_info"]
        wait_for(lambda: not any(alive(s) for s in sched), "the scheduler process to be gone", 5)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def test_engine_stops_within_its_grace_12_times_with_calls_in_flight(model, tmp_path):
    """12 stops (3 rounds of 4 engines at once, one of each kind of signal each round; 5 rounds until the suite's
    time was cut, 2026-12-07)."""
    kinds = ("group", "twice", "engine", "sigint")
    failed = []
    for _ in range(3):
        with ThreadPoolExecutor(len(kinds)) as pool:
            futs = {how: pool.submit(_stop_once, model, tmp_path, how) for how in kinds}
            failed += [f"{how}: {fut.exception()}" for how, fut in futs.items() if fut.exception() is not None]
    assert not failed, "\n\n".join(failed)


PARENT = """
import sys, threading
from asyncrl.cluster.process import install_signal_handlers
from asyncrl.engine.launch import EngineSupervisor
port = int(sys.argv[2])
sup = EngineSupervisor([sys.executable, "-m", "asyncrl.cpu_engine.server", "--model-path", sys.argv[1], "--port",
    str(port)], url=f"http://127.0.0.1:{port}", name="engine", log_dir=sys.argv[3], shutdown_grace_s=float(sys.argv[4]),
    env={"OMP_NUM_THREADS": "1"})
install_signal_handlers(float(sys.argv[4]))
sup.start()
print("ENGINE", sup.pid, flush=True)
threading.Event().wait()
"""


def test_scancel_stops_the_rank_and_its_engine_within_the_grace(model, tmp_path):
    """As ``scancel`` does: SIGTERM to the rank (which then stops its engine with SIGTERM, ``stop_all``) and to the
    engine at the same moment, calls in flight: the rank exits 143 within the grace, without having to kill it."""
    port = free_port()
    p = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(model), str(port), str(tmp_path), str(GRACE_S)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=ENV,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)
    reader.start()
    try:
        engine = int(
            wait_for(lambda: next((x.split()[1] for x in lines if x.startswith("ENGINE")), None), "the engine", 120)
        )
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            calls = [pool.submit(_generate, port, k) for k in range(IN_FLIGHT)]
            wait_for(lambda: _running(port), "the calls to be running", 60)
            t0 = time.monotonic()
            os.kill(p.pid, signal.SIGTERM)
            os.killpg(engine, signal.SIGTERM)
            assert p.wait(timeout=GRACE_S + 5) == 128 + signal.SIGTERM
            took = time.monotonic() - t0
            assert all(c.result(timeout=10)[0] == 200 for c in calls)
        reader.join(5)
        out = "".join(lines)
        engine_log = (tmp_path / "engine.log").read_text(errors="replace")
        assert took < GRACE_S, f"{took:.1f} s\n{out}"
        assert "killing" not in out, out
        assert "Traceback" not in engine_log and "ERROR" not in engine_log, engine_log[-3000:]
        assert not alive(engine)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
