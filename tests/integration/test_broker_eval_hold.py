"""``BrokerClient.hold_issuing`` / ``release_issuing`` against the real broker process and a worker:
while held, finished groups are buffered and no new group is issued; the worker never sees a turn hold."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from asyncrl.broker.client import BrokerClient
from asyncrl.broker.types import Trajectory
from asyncrl.broker.worker_client import Assignment, Control, WorkerConnection
from asyncrl.runner.broker_process import start_broker


def _inputs(tmp: Path) -> tuple[str, str]:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"q{i}", "golden_answers": ["a"]}) + "\n" for i in range(8)))
    cfg = tmp / "b.toml"
    cfg.write_text(
        "[runner]\nasync_mode = true\n[data]\nrollout_batch_size = 2\n[algorithm]\ngroup_size = 2\n"
        "[rollout_buffer]\nmax_inflight_groups = 2\nmax_buffered_groups = 6\n"
    )
    return str(cfg), str(prompts)


def _trajs(n: int = 2) -> list[Trajectory]:
    return [Trajectory([1], [2, 3], [1, 1], [-0.1, -0.2], reward=1.0) for _ in range(n)]


def _assignments(conn: WorkerConnection, n: int, *, timeout_s: float = 20) -> tuple[list[Assignment], list[Control]]:
    got, controls = [], []
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        assert time.monotonic() < deadline, f"only {len(got)} of {n} groups issued within {timeout_s}s"
        for e in conn.poll(0.05):
            (got if isinstance(e, Assignment) else controls).append(e)
    return got, controls


@pytest.mark.slow
@pytest.mark.timeout(120)  # a failure bound, generous for a loaded machine
def test_hold_issuing_buffers_inflight_and_issues_nothing_new(tmp_path):
    cfg, prompts = _inputs(tmp_path)
    broker = start_broker(cfg, [], prompts_path=prompts, log_path=str(tmp_path / "broker.log"))
    client = BrokerClient(broker.address, timeout_s=20)
    conn = WorkerConnection(broker.address, worker_id="w", capacity=4, heartbeat_interval_s=0.5)
    try:
        conn.connect(timeout_s=20)
        first, _ = _assignments(conn, 2)
        client.hold_issuing()
        assert client.status()["issuing_held"] is True
        for a in first:  # in-flight groups finish during the hold
            conn.send_group(a.group_id, _trajs())
        deadline = time.monotonic() + 20
        while client.status()["num_buffered_groups"] < 2:
            assert time.monotonic() < deadline
            events = conn.poll(0.05)
            assert not [e for e in events if isinstance(e, Assignment)], "issued while held"
            assert not [e for e in events if isinstance(e, Control) and e.hold], "turns held by an eval hold"
        st = client.status()
        assert st["num_inflight_groups"] == 0 and st["counters"].get("dropped", 0) == 0 and st["hold"] is False
        batch = client.get_batch(1, timeout_s=20)  # buffered groups are still handed to the actor
        assert sorted(g.group_id for g in batch.groups) == sorted(a.group_id for a in first)
        # the trainer's sample filter removed one of them: dropped, not trained; a bad report is an
        # error reply naming the message, and the broker goes on
        client.batch_filtered([first[0].group_id])
        with pytest.raises(Exception, match="batch_filtered"):
            client.batch_filtered([first[0].group_id])
        c = client.status()["counters"]
        assert c["trained"] == 1 and c["dropped"] == 1 and c["sample_filtered"] == 1
        client.release_issuing()
        again, _ = _assignments(conn, 2)
        assert min(a.group_id for a in again) > max(a.group_id for a in first)
        client.shutdown()
        assert broker.proc.wait(timeout=20) == 0
    finally:
        conn.close(say_bye=False)
        client.close()
        broker.stop()
