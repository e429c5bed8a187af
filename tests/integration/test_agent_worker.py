"""The agent worker end to end: the real broker process, the worker, the CPU engine and the Search-R1
retrieval server over HTTP. The worker generates groups the actor-side client receives as a batch;
then the retrieval server is killed: the worker reports aborted groups, the broker drops them
(never trains on them); shutdown from the broker stops the worker."""

import threading
import time
from pathlib import Path

import pytest
from agent_fixtures import make_scripted_model, start_cpu_engine, start_retrieval_server

from asyncrl.agent.worker import run_worker
from asyncrl.broker.client import BrokerClient
from asyncrl.config import load_config
from asyncrl.runner.broker_process import start_broker

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_worker_batches_then_aborted_groups_then_shutdown(tmp_path):
    model = make_scripted_model(tmp_path)
    engine, engine_url = start_cpu_engine(model.path, tmp_path / "engine.log")
    retrieval, retrieve_url = start_retrieval_server(model.data_dir / "corpus.jsonl", tmp_path / "retrieval.log")
    overrides = [
        f"data.train_path={model.data_dir / 'train.jsonl'}", "data.rollout_batch_size=2", "algorithm.group_size=2",
        "agentloop.max_turns=2", "agentloop.tool.retriever=http", f"agentloop.tool.retriever_url={retrieve_url}",
        "agentloop.tool.max_retries=1", "agentloop.tool.retry_backoff_s=0.05", "agentloop.tool.timeout_s=30",
        "agentloop.heartbeat_interval_s=0.5", "rollout_buffer.max_inflight_groups=2",
        "rollout_buffer.max_buffered_groups=4", f"logging.run_dir={tmp_path / 'run'}",
    ]
    cfg = load_config(REPO / "configs" / "tiny.toml", overrides)
    broker = start_broker(str(REPO / "configs" / "tiny.toml"), overrides, log_path=str(tmp_path / "broker.log"))
    client = BrokerClient(broker.address, timeout_s=30)
    result = {}

    def worker_body():
        try:
            result["stats"] = run_worker(cfg, broker_address=broker.address, engine_urls=[engine_url],
                                         tokenizer_path=str(model.path), worker_id="engine0")
        except BaseException as exc:  # surfaced by the assertions below
            result["error"] = exc

    thread = threading.Thread(target=worker_body, daemon=True)
    thread.start()
    try:
        batch = client.get_batch(0, timeout_s=120, as_lists=True)
        assert len(batch.groups) == 2
        for g in batch.groups:
            assert not g.aborted and len(g.trajectories) == 2
            for t in g.trajectories:
                assert len(t.loss_mask) == len(t.response_ids) == len(t.rollout_logprobs) == len(t.weight_versions)
                assert 0 in t.loss_mask and 1 in t.loss_mask and t.num_tool_calls == 1
                assert all((m == 1) == (v >= 0) for m, v in zip(t.loss_mask, t.weight_versions))
                assert all(lp == 0.0 for m, lp in zip(t.loss_mask, t.rollout_logprobs) if m == 0)

        retrieval.stop()  # every later search fails: the worker reports aborted groups
        deadline = time.monotonic() + 90
        while client.metrics()["counters"].get("dropped", 0) < 1:
            assert time.monotonic() < deadline, "no aborted group reached the broker"
            assert "error" not in result, result.get("error")
            time.sleep(0.2)
        client.shutdown()
        thread.join(timeout=60)
        assert not thread.is_alive(), "worker did not stop on shutdown"
        assert "error" not in result, result.get("error")
        stats = result["stats"]
        assert stats["groups_aborted"] >= 1 and stats["trajectories_aborted"] >= 1
        assert stats["groups_done"] >= 2
    finally:
        client.close()
        broker.stop()
        retrieval.stop()
        engine.stop()
        thread.join(timeout=30)
