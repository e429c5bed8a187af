"""``max_inflight_groups = "auto"`` in the real broker process: the actor reports the engines' figures
(``BrokerClient.engine_figures``), a malformed report is an error reply and the broker goes on, and a
report of engines queueing requests lowers the in-flight limit at the next hand-off."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from asyncrl.broker.client import BrokerClient
from asyncrl.broker.types import Trajectory
from asyncrl.broker.worker_client import Assignment, WorkerConnection
from asyncrl.runner.broker_process import start_broker


def _inputs(tmp: Path) -> tuple[str, str]:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"q{i}", "golden_answers": ["a"]}) + "\n" for i in range(32)))
    cfg = tmp / "b.toml"
    cfg.write_text(
        "[runner]\nasync_mode = true\n[data]\nrollout_batch_size = 2\n[algorithm]\ngroup_size = 2\n"
        '[rollout_buffer]\nmax_inflight_groups = "auto"\nmax_buffered_groups = 6\n'
    )
    return str(cfg), str(prompts)


def _answer_all(conn: WorkerConnection, until: float) -> None:
    """Finish every group issued so far (the worker side of a step)."""
    while time.monotonic() < until:
        events = conn.poll(0.02)
        for a in [e for e in events if isinstance(e, Assignment)]:
            conn.send_group(a.group_id, [Trajectory([1], [2, 3], [1, 1], [-0.1, -0.2], reward=1.0)] * 2)
        if not events:
            return


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_engine_queue_report_lowers_the_auto_limit(tmp_path):
    cfg, prompts = _inputs(tmp_path)
    broker = start_broker(cfg, [], prompts_path=prompts, log_path=str(tmp_path / "broker.log"))
    client = BrokerClient(broker.address, timeout_s=20)
    conn = WorkerConnection(broker.address, worker_id="w", capacity=8, heartbeat_interval_s=0.5)
    try:
        conn.connect(timeout_s=20)
        with pytest.raises(Exception, match="engine_figures"):
            client.engine_figures(running_reqs=-1, queue_reqs=0, gen_tokens_per_s=10)
        limits, changes = [], []
        for step in range(1, 5):  # two warm-up steps, then the queue report acts
            client.engine_figures(running_reqs=10, queue_reqs=10, gen_tokens_per_s=500)  # half of them queue
            deadline = time.monotonic() + 20
            while True:
                _answer_all(conn, deadline)
                try:
                    batch = client.get_batch(step, timeout_s=0.2)
                    break
                except TimeoutError:
                    assert time.monotonic() < deadline, f"no batch for step {step}"
            limits.append(batch.metrics["rollout/buffer/inflight_limit"])
            changes.append(batch.metrics.get("rollout/buffer/inflight_limit_change", 0.0))
        assert limits[0] == 4  # the derived start, capped at max_buffered_groups - rollout_batch_size
        assert limits[-1] < limits[0] and min(changes) < 0, (limits, changes)
        assert "engines queue" in (tmp_path / "broker.log").read_text()
        client.shutdown()
        assert broker.proc.wait(timeout=20) == 0
    finally:
        conn.close(say_bye=False)
        client.close()
        broker.stop()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_flat_throughput_while_the_actor_waits_does_not_walk_the_limit_down(tmp_path):
    """The loaded CPU default (issue 42): the in-flight limit binds, the actor waits for every batch, and the engines'
    tokens/s read the same whatever the limit (the machine's load, not the limit, sets them). Before, auto read the
    flat throughput as over-admission and walked 4 -> 2 -> 1; generation sets the pace here and the engines queue
    nothing, so the limit stays, and the broker writes and logs which side binds."""
    cfg, prompts = _inputs(tmp_path)
    broker = start_broker(cfg, [], prompts_path=prompts, log_path=str(tmp_path / "broker.log"))
    client = BrokerClient(broker.address, timeout_s=20)
    conn = WorkerConnection(broker.address, worker_id="w", capacity=8, heartbeat_interval_s=0.5)
    pending: list[Assignment] = []
    try:
        conn.connect(timeout_s=20)
        limits, sides = [], []
        for step in range(1, 8):
            client.engine_figures(running_reqs=8, queue_reqs=0, gen_tokens_per_s=500)  # flat, no queue
            deadline = time.monotonic() + 20
            while True:
                try:  # the actor asks first and waits (nothing is answered yet): generation sets the pace
                    batch = client.get_batch(step, timeout_s=0.2)
                    break
                except TimeoutError:
                    assert time.monotonic() < deadline, f"no batch for step {step}"
                pending += [e for e in conn.poll(0.05) if isinstance(e, Assignment)]
                for a in pending[:2]:  # a batch's worth (rollout_batch_size 2), oldest first: the rest stay in flight
                    conn.send_group(a.group_id, [Trajectory([1], [2, 3], [1, 1], [-0.1, -0.2], reward=1.0)] * 2)
                pending = pending[2:]
            limits.append(batch.metrics["rollout/buffer/inflight_limit"])
            sides.append(batch.metrics["rollout/buffer/training_bound"])
        assert limits == [4.0] * 7, limits  # the derived start, capped at max_buffered_groups - rollout_batch_size
        assert sides[1:] == [0.0] * 6, sides
        assert "generation sets the pace" in (tmp_path / "broker.log").read_text()
        client.shutdown()
        assert broker.proc.wait(timeout=20) == 0
    finally:
        conn.close(say_bye=False)
        client.close()
        broker.stop()
