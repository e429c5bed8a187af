"""The real broker process, real worker processes over ZeroMQ and a real consumer (the actor's client).

A worker is killed mid-group (it reported one trajectory of each of its groups, then dies); its
groups are re-issued to the surviving workers and trained. Also: malformed messages are counted and
survived, drain syncs reach the workers, checkpoint state round-trips, shutdown stops everyone.

This file doubles as the worker program: ``python test_broker_process.py --worker ADDR ID MODE``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

REPO = str(Path(__file__).resolve().parents[2])
sys.path.insert(0, REPO)

from asyncrl.broker import protocol as P  # noqa: E402
from asyncrl.broker.client import BrokerClient  # noqa: E402
from asyncrl.broker.types import Trajectory  # noqa: E402
from asyncrl.broker.worker_client import Assignment, Cancel, Control, Shutdown, WorkerConnection  # noqa: E402
from asyncrl.runner.broker_process import start_broker  # noqa: E402


def _worker_main(address: str, worker_id: str, mode: str) -> int:
    conn = WorkerConnection(address, worker_id=worker_id, capacity=4, heartbeat_interval_s=0.2)
    welcome = conn.connect(timeout_s=20)
    version = welcome.version
    deadline = time.monotonic() + 60  # never outlive the test
    while time.monotonic() < deadline:
        for ev in conn.poll(0.05):
            if isinstance(ev, Shutdown):
                conn.close()  # its bye tells the broker the shutdown arrived (the broker waits for it)
                return 0
            if isinstance(ev, Control):
                version = ev.version
                print(f"CONTROL {int(ev.hold)} {ev.version}", flush=True)
            elif isinstance(ev, Cancel):
                pass
            elif isinstance(ev, Assignment):
                print(f"GOT {ev.group_id} {ev.item.index} {ev.epoch}", flush=True)
                if mode == "victim":  # one trajectory done, then it hangs until killed: mid-group
                    conn.send_done(ev.group_id, 0)
                    conn.flush()
                    continue
                trajs = []
                for i in range(ev.group_size):
                    n = 3 + i
                    t = Trajectory(
                        prompt_ids=[ev.item.index, 1, 2],
                        response_ids=list(range(n)),
                        loss_mask=[1] * n,
                        rollout_logprobs=[-0.1] * n,
                        reward=float(i % 2),
                        weight_versions=[version] * n,
                        min_version=version,
                        max_version=version,
                        finish_reason="answer",
                    )
                    if welcome.per_trajectory:
                        conn.send_done(ev.group_id, i)
                    trajs.append(t)
                conn.send_group(ev.group_id, trajs)
    return 1


def _write_inputs(tmp: Path) -> tuple[str, str]:
    prompts = tmp / "prompts.jsonl"
    with prompts.open("w") as f:
        for i in range(12):
            f.write(json.dumps({"question": f"question {i}", "golden_answers": [f"answer {i}"]}) + "\n")
    cfg = tmp / "broker.toml"
    cfg.write_text(
        "[runner]\nasync_mode = true\nseed = 5\n"
        "[data]\nrollout_batch_size = 4\n"
        "[algorithm]\ngroup_size = 2\n"
        "[agentloop]\nheartbeat_interval_s = 0.2\n"
        '[rollout_buffer]\nsubmission_granularity = "group"\nmax_inflight_groups = 4\nmax_buffered_groups = 8\nworker_heartbeat_timeout_s = 3.0\n'
        "no_data_warning_s = 5.0\n"
    )
    return str(cfg), str(prompts)


def _spawn_worker(address: str, worker_id: str, mode: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.Popen(
        [sys.executable, __file__, "--worker", address, worker_id, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _read_got(proc: subprocess.Popen, n: int, timeout_s: float) -> list[tuple[int, int, int]]:
    got = []
    deadline = time.monotonic() + timeout_s
    buf = ""
    while len(got) < n:
        assert time.monotonic() < deadline, f"worker got {got} within {timeout_s}s, expected {n} groups"
        assert proc.poll() is None, proc.stderr.read()
        if select.select([proc.stdout], [], [], 0.1)[0]:
            buf += os.read(proc.stdout.fileno(), 65536).decode()
            *lines, buf = buf.split("\n")
            got += [tuple(map(int, ln.split()[1:])) for ln in lines if ln.startswith("GOT")]
    return got


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_killed_worker_groups_are_reissued_and_trained(tmp_path):
    cfg, prompts = _write_inputs(tmp_path)
    broker = start_broker(cfg, [], prompts_path=prompts, log_path=str(tmp_path / "broker.log"), timeout_s=30)
    procs: list[subprocess.Popen] = []
    client = BrokerClient(broker.address, timeout_s=20)
    try:
        victim = _spawn_worker(broker.address, "victim", "victim")
        procs.append(victim)
        victim_groups = _read_got(victim, 4, timeout_s=30)  # alone, it gets every in-flight group
        lost = {(idx, epoch) for _, idx, epoch in victim_groups}
        deadline = time.monotonic() + 30
        while (status := client.status())["num_inflight_samples"] != 4:  # one of 2 trajectories done per group
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert status["workers"] == {"victim": 4}

        healthy = [_spawn_worker(broker.address, f"w{i}", "ok") for i in range(2)]
        procs += healthy
        deadline = time.monotonic() + 30
        while set(client.status()["workers"]) != {"victim", "w0", "w1"}:  # joined; nothing to do yet
            assert time.monotonic() < deadline and all(p.poll() is None for p in healthy)
            time.sleep(0.05)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)

        # a malformed and an other-version message: logged, counted, never fatal
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(broker.address)
        raw.send_multipart([b"\xc1garbage"])
        raw.send_multipart([P.encode("hello")[0].replace(b"\x01", b"\x07", 1)])
        assert raw.poll(10_000)
        assert P.decode(raw.recv_multipart()).type == P.ERROR
        raw.close()

        trained = []
        for step in range(3):
            batch = client.get_batch(step, timeout_s=30)
            assert batch.step == step and len(batch.groups) == 4
            for g in batch.groups:
                assert len(g.trajectories) == 2 and g.trajectories[1].response_ids.tolist() == [0, 1, 2, 3]
                assert g.trajectories[0].prompt_ids[0] == g.item.index
                assert 0 <= g.min_version <= step
            trained += [(g.item.index, g.epoch, g.group_id) for g in batch.groups]
            assert 0.0 <= batch.metrics["rollout/buffer/admission_wait_buffer_full"] <= 1.0
            client.sync_begin("drain")
            client.sync_end(step + 1)
        victim_ids = {gid for gid, _, _ in victim_groups}
        retrained = {(idx, epoch) for idx, epoch, gid in trained if gid not in victim_ids}
        assert lost <= retrained, f"groups of the killed worker {lost} were not all re-issued and trained"
        assert not victim_ids & {gid for _, _, gid in trained}

        m = client.metrics()
        assert m["counters"]["reissued"] >= 4 and m["counters"]["trained"] == 12
        assert m["status"]["stats"]["malformed"] == 2
        assert set(m["status"]["workers"]) == {"w0", "w1"}
        assert m["metrics"]["rollout/weight_version"] == 2

        blob = client.get_state()
        client.set_state(blob)  # resume semantics: in-flight groups cancelled and re-issued
        st = client.status()
        assert st["version"] == 3 and st["num_inflight_groups"] + st["num_buffered_groups"] <= 8
        client.shutdown()
        assert broker.proc.wait(timeout=20) == 0
        for p in healthy:
            assert p.wait(timeout=20) == 0
            out = p.stdout.read()
            assert "CONTROL 1 " in out  # the drain hold reached the workers
    finally:
        client.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        broker.stop()


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        sys.exit(_worker_main(sys.argv[2], sys.argv[3], sys.argv[4]))
    sys.exit(f"usage: {sys.argv[0]} --worker ADDRESS WORKER_ID ok|victim")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_no_completed_groups_warning_reaches_the_console_not_only_the_log(tmp_path, capfd):
    cfg, prompts = _write_inputs(tmp_path)
    log = tmp_path / "broker.log"
    broker = start_broker(
        cfg, ["rollout_buffer.no_data_warning_s=0.5"], prompts_path=prompts, log_path=str(log), timeout_s=30
    )
    client = BrokerClient(broker.address, timeout_s=20)
    try:
        with pytest.raises(TimeoutError):
            client.get_batch(0, timeout_s=2.0)  # no worker: the actor waits and nothing arrives
        deadline, out = time.monotonic() + 20, ""
        while "No completed rollout groups for 0.5s" not in out:
            assert time.monotonic() < deadline, f"no warning on the console; console: {out!r}"
            out += capfd.readouterr().out
            time.sleep(0.05)
        assert "[broker] WARNING No completed rollout groups" in out
        assert "No completed rollout groups" in log.read_text()  # and still in the log
    finally:
        client.close()
        broker.stop()


def _gone(pid: int) -> bool:
    """Exited (a zombie nobody reaped counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]
    except (FileNotFoundError, IndexError):
        return True
    return state == "Z"


def _wait_for(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_supervised_broker_defers_sigterm_while_its_parent_lives(tmp_path):
    """A preemption's SIGTERM reaches every process of a Slurm step: the broker of a live parent (actor rank 0)
    keeps serving (the parent's checkpoint needs its state) and stops on SIGINT (``process.stop_child``); a broker
    on its own still stops on SIGTERM."""
    cfg, prompts = _write_inputs(tmp_path)
    log = tmp_path / "broker.log"
    broker = start_broker(cfg, [], prompts_path=prompts, log_path=str(log), parent_pid=os.getpid())
    client = BrokerClient(broker.address, timeout_s=20)
    try:
        os.kill(broker.proc.pid, signal.SIGTERM)
        _wait_for(lambda: "SIGTERM deferred" in log.read_text(), 20, "the broker to report the deferred SIGTERM")
        state = client.get_state()  # what the parent's checkpoint asks for, after the SIGTERM
        assert state and broker.proc.poll() is None
        os.kill(broker.proc.pid, signal.SIGINT)
        assert broker.proc.wait(timeout=20) == 0
    finally:
        client.close()
        if broker.proc.poll() is None:
            broker.proc.kill()
    alone = start_broker(cfg, [], prompts_path=prompts, log_path=str(tmp_path / "alone.log"))
    os.kill(alone.proc.pid, signal.SIGTERM)
    assert alone.proc.wait(timeout=20) == 0


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_supervised_broker_stops_when_its_parent_dies(tmp_path):
    """No PR_SET_PDEATHSIG here (``start_broker`` does not set it): the broker's own watch of its parent pid stops it
    once the parent is SIGKILLed."""
    cfg, prompts = _write_inputs(tmp_path)
    code = (
        "import os, sys; from asyncrl.runner.broker_process import start_broker; "
        f"b = start_broker({cfg!r}, [], prompts_path={prompts!r}, log_path={str(tmp_path / 'broker.log')!r}, "
        "parent_pid=os.getpid()); print('PID', b.proc.pid, flush=True); sys.stdin.read()"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    pid = None
    try:
        pid = next(int(ln.split()[1]) for ln in parent.stdout if ln.startswith("PID "))  # the broker prints too
        parent.kill()
        parent.wait(timeout=10)
        _wait_for(lambda: _gone(pid), 10, f"the broker (pid {pid}) to stop after its parent died")
    finally:
        parent.kill()
        parent.wait(timeout=10)
        if pid is not None and not _gone(pid):
            os.kill(pid, signal.SIGKILL)
