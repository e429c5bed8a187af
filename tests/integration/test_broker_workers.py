"""Worker-side clients against the real broker process: the asyncio connection (drain hold, version),
a worker that goes silent, is declared dead, re-registers on ``rehello`` and gets new groups, the shutdown's
wait for the workers' byes, and a worker whose broker process is killed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from asyncrl.broker import protocol as P
from asyncrl.broker.client import BrokerClient
from asyncrl.broker.types import Trajectory
from asyncrl.broker.worker_client import (
    Assignment,
    AsyncWorkerConnection,
    BrokerLost,
    Control,
    Shutdown,
    WorkerConnection,
)
from asyncrl.runner.broker_process import start_broker


def _inputs(tmp: Path, rollout_buffer: str) -> tuple[str, str]:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"q{i}", "golden_answers": ["a"]}) + "\n" for i in range(6)))
    cfg = tmp / "b.toml"
    cfg.write_text(
        "[runner]\nasync_mode = true\n[data]\nrollout_batch_size = 2\n[algorithm]\ngroup_size = 2\n"
        f"[rollout_buffer]\nmax_inflight_groups = 2\nmax_buffered_groups = 4\n{rollout_buffer}"
    )
    return str(cfg), str(prompts)


def _trajs(version: int, n: int = 2) -> list[Trajectory]:
    return [
        Trajectory(
            [1],
            [2, 3],
            [1, 1],
            [-0.1, -0.2],
            reward=1.0,
            weight_versions=[version] * 2,
            min_version=version,
            max_version=version,
        )
        for _ in range(n)
    ]


@pytest.mark.slow
@pytest.mark.timeout(120)  # a failure bound, generous for a loaded machine
def test_async_worker_connection_serves_and_sees_the_drain_hold(tmp_path):
    cfg, prompts = _inputs(tmp_path, "")
    broker = start_broker(cfg, [], prompts_path=prompts, log_path=str(tmp_path / "broker.log"))
    client = BrokerClient(broker.address, timeout_s=20)
    held = [threading.Event(), threading.Event()]  # step k's hold (version k) has reached the worker

    def consume() -> list[int]:
        versions = []
        for step in range(2):
            batch = client.get_batch(step, timeout_s=20)
            versions += [g.min_version for g in batch.groups]
            client.sync_begin("drain")
            assert held[step].wait(30), f"step {step}: the worker never saw the drain hold"
            client.sync_end(step + 1)
        return versions

    async def serve() -> tuple[list[Control], list[int]]:
        conn = AsyncWorkerConnection(broker.address, worker_id="aw", capacity=4, heartbeat_interval_s=0.1)
        welcome = await conn.connect(timeout_s=20)
        assert (welcome.version, welcome.group_size, welcome.hold) == (0, 2, False)
        version, controls = 0, []
        consumer = asyncio.ensure_future(asyncio.to_thread(consume))
        deadline = time.monotonic() + 60
        # the last control (release, version 2) can arrive after the consumer returned: wait for it too
        while not (consumer.done() and version == 2):
            if consumer.done() and consumer.exception() is not None:
                break  # raised below
            assert time.monotonic() < deadline, f"no release to version 2 within 60 s; controls: {controls}"
            ev = await conn.recv(timeout_s=0.05)
            if isinstance(ev, Control):
                controls.append(ev)
                version = ev.version
                if ev.hold:
                    held[ev.version].set()
            elif isinstance(ev, Assignment):
                await conn.send_group(ev.group_id, _trajs(version))
        await conn.close()
        return controls, await consumer

    try:
        controls, versions = asyncio.run(serve())
        assert [(c.hold, c.version) for c in controls] == [(True, 0), (False, 1), (True, 1), (False, 2)]
        assert versions[:2] == [0, 0] and all(v <= 1 for v in versions)
        client.shutdown()
        assert broker.proc.wait(timeout=20) == 0
    finally:
        client.close()
        broker.stop()


@pytest.mark.slow
@pytest.mark.timeout(120)  # a failure bound, generous for a loaded machine
def test_silent_worker_is_declared_dead_and_rejoins_on_rehello(tmp_path):
    cfg, prompts = _inputs(tmp_path, "worker_heartbeat_timeout_s = 0.5\n")
    broker = start_broker(cfg, [], prompts_path=prompts, log_path=str(tmp_path / "broker.log"))
    client = BrokerClient(broker.address, timeout_s=20)
    conn = WorkerConnection(broker.address, worker_id="quiet", capacity=4, heartbeat_interval_s=30.0)
    try:
        conn.connect(timeout_s=20)
        first: list[Assignment] = []
        deadline = time.monotonic() + 20
        while len(first) < 2:
            assert time.monotonic() < deadline
            first += [e for e in conn.poll(0.1) if isinstance(e, Assignment)]
        deadline = time.monotonic() + 20
        while client.status()["workers"]:  # silent past worker_heartbeat_timeout_s: declared dead
            assert time.monotonic() < deadline
            time.sleep(0.1)
        for a in first:  # its late results are ignored; the broker answers "rehello"
            conn.send_group(a.group_id, _trajs(0))
        again: list[Assignment] = []
        deadline = time.monotonic() + 20
        while len(again) < 2:
            assert time.monotonic() < deadline
            again += [e for e in conn.poll(0.1) if isinstance(e, Assignment)]
        assert {a.item.index for a in again} == {a.item.index for a in first}  # re-issued, same prompts
        assert min(a.group_id for a in again) > max(a.group_id for a in first)
        st = client.status()
        assert st["counters"]["reissued"] == 2 and st["stats"]["unknown_worker"] >= 1
        for a in again:
            conn.send_group(a.group_id, _trajs(0))
        batch = client.get_batch(0, timeout_s=20)
        assert sorted(g.group_id for g in batch.groups) == sorted(a.group_id for a in again)
        client.shutdown()
        assert broker.proc.wait(timeout=20) == 0
    finally:
        conn.close(say_bye=False)
        client.close()
        broker.stop()


@pytest.mark.slow
@pytest.mark.timeout(120)  # a failure bound, generous for a loaded machine
def test_finished_groups_travel_together_sync_and_async(tmp_path):
    """``send_group(..., flush=False)`` + ``flush()`` (blocking) and groups finished in one event-loop turn
    (asyncio) reach the broker as ONE ``groups`` message each, and are trained like groups sent one by one."""
    cfg, prompts = _inputs(tmp_path, "")
    cfg_path = Path(cfg)
    cfg_path.write_text(
        cfg_path.read_text()
        .replace("max_inflight_groups = 2", "max_inflight_groups = 4")
        .replace("max_buffered_groups = 4", "max_buffered_groups = 8")
    )
    broker = start_broker(cfg, [], prompts_path=prompts, log_path=str(tmp_path / "broker.log"))
    client = BrokerClient(broker.address, timeout_s=20)
    conn = WorkerConnection(broker.address, worker_id="sync", capacity=8, heartbeat_interval_s=1.0)
    try:
        conn.connect(timeout_s=20)
        got: list[Assignment] = []
        deadline = time.monotonic() + 20
        while len(got) < 4:
            assert time.monotonic() < deadline
            got += [e for e in conn.poll(0.1) if isinstance(e, Assignment)]
        for a in got[:3]:
            conn.send_group(a.group_id, _trajs(0), flush=False)
        conn.send_group(got[3].group_id, None, aborted=True, error="tool http://r down", flush=False)
        conn.flush()
        b0 = client.get_batch(0, timeout_s=20)
        st = client.status()
        assert st["stats"]["worker_groups"] == 1 and st["stats"].get("worker_group", 0) == 0  # one message
        assert st["counters"]["finished"] == 4 and st["counters"]["dropped"] == 1
        assert sorted(g.group_id for g in b0.groups) == sorted(a.group_id for a in got[:2])
        # the per-group ``group`` message of older workers is gone: refused as malformed, nothing finishes
        more: list[Assignment] = []
        deadline = time.monotonic() + 20
        while not more:
            assert time.monotonic() < deadline
            more = [e for e in conn.poll(0.1) if isinstance(e, Assignment)]
        conn.sock.send_multipart(P.encode("group", {"group_id": more[0].group_id, "aborted": False, "trajs": []}))
        conn.send_group(more[0].group_id, _trajs(0))  # the same group, as workers send it
        deadline = time.monotonic() + 20
        while client.status()["counters"]["finished"] < 5:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        st = client.status()
        assert st["stats"]["malformed"] == 1 and st["stats"]["worker_groups"] == 2
        conn.close()

        async def serve_async() -> None:
            aconn = AsyncWorkerConnection(broker.address, worker_id="async", capacity=8, heartbeat_interval_s=1.0)
            await aconn.connect(timeout_s=20)
            mine: list[Assignment] = []
            while len(mine) < 3:
                ev = await aconn.recv(timeout_s=20)
                assert ev is not None
                if isinstance(ev, Assignment):
                    mine.append(ev)
            await asyncio.gather(*(aconn.send_group(a.group_id, _trajs(0)) for a in mine[:3]))
            await aconn.close()

        asyncio.run(serve_async())
        b1 = client.get_batch(1, timeout_s=20)
        st = client.status()
        assert st["stats"]["worker_groups"] == 3  # the three concurrent send_group calls: one message
        assert len(b1.groups) == 2 and st["counters"]["trained"] == 4
        client.shutdown()
        assert broker.proc.wait(timeout=20) == 0
    finally:
        client.close()
        broker.stop()


@pytest.mark.slow
@pytest.mark.timeout(120)  # a failure bound, generous for a loaded machine
def test_broker_shutdown_waits_for_the_workers_byes_and_names_a_silent_one(tmp_path):
    """The broker stops only once each worker it told to shut down said bye (the proof the message arrived: one
    still queued in ZeroMQ's thread when the process exits is lost, and that worker's rank never ends); a worker
    that never answers is named, and the broker still stops, after ``shutdown_grace_s``."""
    cfg, prompts = _inputs(tmp_path, "")
    log_path = tmp_path / "broker.log"
    broker = start_broker(cfg, [], prompts_path=prompts, log_path=str(log_path))
    client = BrokerClient(broker.address, timeout_s=20)
    mute = WorkerConnection(broker.address, worker_id="mute", capacity=2, heartbeat_interval_s=1.0)
    joined = threading.Event()

    async def polite() -> bool:
        conn = AsyncWorkerConnection(broker.address, worker_id="polite", capacity=2, heartbeat_interval_s=1.0)
        await conn.connect(timeout_s=20)
        joined.set()
        deadline = time.monotonic() + 60
        while not isinstance(await conn.recv(timeout_s=0.1), Shutdown):
            assert time.monotonic() < deadline, "the shutdown never reached the worker"
        alive = broker.proc.poll() is None  # the broker waits for this worker's bye (and the mute one's)
        await conn.close()  # says bye
        return alive

    try:
        mute.connect(timeout_s=20)  # then never reads again: it cannot answer the shutdown
        result: list[bool] = []
        worker = threading.Thread(target=lambda: result.append(asyncio.run(polite())), daemon=True)
        worker.start()
        assert joined.wait(30), "the polite worker did not connect"
        deadline = time.monotonic() + 20
        while len(client.status()["workers"]) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        client.shutdown()
        worker.join(timeout=60)
        assert result, "the polite worker failed (see the log above)"
        alive = result[0]
        assert alive, "the broker exited before the worker it told to shut down said bye"
        assert broker.proc.wait(timeout=30) == 0
        text = log_path.read_text()
        assert "shut down: 2 workers told, no bye from [mute]" in text, text[-2000:]
        assert "left with" not in text and "gone (said bye)" not in text, text[-2000:]  # a bye here is no loss
    finally:
        mute.close(say_bye=False)
        client.close()
        broker.stop()


@pytest.mark.slow
@pytest.mark.timeout(120)  # a failure bound, generous for a loaded machine
def test_async_worker_stops_naming_the_broker_once_its_process_is_killed(tmp_path):
    """A broker that dies (SIGKILL: no ``shutdown`` ever comes) ends the worker's wait: once its connection has
    stayed closed ``broker_lost_after_s``, ``recv`` raises ``BrokerLost`` naming the broker and the worker."""
    cfg, prompts = _inputs(tmp_path, "")
    broker = start_broker(cfg, [], prompts_path=prompts, log_path=str(tmp_path / "broker.log"))

    async def serve() -> tuple[str, float]:
        conn = AsyncWorkerConnection(broker.address, worker_id="orphan", capacity=2, heartbeat_interval_s=0.2)
        await conn.connect(timeout_s=20)
        for _ in range(5):  # alive and talking: no BrokerLost
            await conn.recv(timeout_s=0.1)
        os.kill(broker.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        try:
            while time.monotonic() - killed < 60:
                await conn.recv(timeout_s=0.2)
        except BrokerLost as e:
            return str(e), time.monotonic() - killed
        finally:
            await conn.close(say_bye=False)
        raise AssertionError("the worker never noticed its broker was killed")

    try:
        message, after_s = asyncio.run(serve())
        assert broker.address in message and "'orphan'" in message, message
        assert after_s >= 5.0, after_s  # not before broker_lost_after_s (a reconnect may still come)
    finally:
        broker.stop()
