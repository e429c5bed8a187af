"""The agent worker end to end: the real broker process, the worker, the CPU engine and the Search-R1
retrieval server over HTTP. The worker generates groups the actor-side client receives as a batch;
then the retrieval server is killed: new turns wait (nothing is trained from groups that happened not
to search, nothing is dropped), the server comes back on the same port and every later trajectory has
its search answered (its failed attempts counted in ``extra["tool_errors"]``); killed again past
``agentloop.tool.max_outage_s``, the worker fails naming the URL."""

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


def _wait(cond, what: str, timeout_s: float, result: dict) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        assert "error" not in result, result.get("error")
        time.sleep(0.1)


def _check_answered(groups) -> int:
    """Every trajectory searched once and got its answer; returns the failed attempts they went through."""
    errors = 0
    for g in groups:
        assert not g.aborted and len(g.trajectories) == 2
        for t in g.trajectories:
            assert not t.aborted and t.num_tool_calls == 1, (t.error, t.num_tool_calls)
            assert 0 in t.loss_mask and 1 in t.loss_mask
            errors += t.extra.get("tool_errors", 0)
    return errors


def test_worker_holds_through_a_retriever_outage_then_fails_past_the_budget(tmp_path):
    from asyncrl.agent.tools import RetrieverOutageError, make_retriever

    model = make_scripted_model(tmp_path)
    engine, engine_url = start_cpu_engine(model.path, tmp_path / "engine.log")
    retrieval, retrieve_url = start_retrieval_server(model.data_dir / "corpus.jsonl", tmp_path / "retrieval.log")
    overrides = [
        f"data.train_path={model.data_dir / 'train.jsonl'}",
        "data.rollout_batch_size=2",
        "algorithm.group_size=2",
        "agentloop.max_turns=2",
        "agentloop.tool.retriever=http",
        f"agentloop.tool.retriever_url={retrieve_url}",
        "agentloop.tool.max_retries=1",
        "agentloop.tool.retry_backoff_s=0.05",
        "agentloop.tool.timeout_s=30",
        "agentloop.tool.max_outage_s=120",
        "agentloop.heartbeat_interval_s=0.5",
        "rollout_buffer.max_inflight_groups=2",
        "rollout_buffer.max_buffered_groups=4",
        f"logging.run_dir={tmp_path / 'run'}",
    ]
    cfg = load_config(REPO / "configs" / "tiny.toml", overrides)
    retriever = make_retriever(cfg.agentloop.tool)
    broker = start_broker(str(REPO / "configs" / "tiny.toml"), overrides, log_path=str(tmp_path / "broker.log"))
    client = BrokerClient(broker.address, timeout_s=30)
    result = {}

    def worker_body():
        try:
            result["stats"] = run_worker(
                cfg,
                broker_address=broker.address,
                engine_urls=[engine_url],
                tokenizer_path=str(model.path),
                worker_id="engine0",
                retriever=retriever,
            )
        except BaseException as exc:  # surfaced by the assertions below
            result["error"] = exc

    thread = threading.Thread(target=worker_body, daemon=True)
    thread.start()
    try:
        batch = client.get_batch(0, timeout_s=120)
        assert len(batch.groups) == 2 and _check_answered(batch.groups) == 0

        retrieval.stop()  # an outage: new turns wait instead of finishing groups that never searched
        _wait(lambda: retriever.down, "the worker never declared the outage", 60, result)
        issued = client.metrics()["counters"]["issued"]
        port = int(retrieve_url.rsplit(":", 1)[1].split("/")[0])
        retrieval, _ = start_retrieval_server(model.data_dir / "corpus.jsonl", tmp_path / "retrieval2.log", port=port)
        _wait(lambda: not retriever.down, "the worker did not resume after the retriever came back", 60, result)

        errors, step = 0, 1
        while errors == 0:  # batches until the groups held through the outage arrive (buffered ones came first)
            assert step < 8, "no trajectory went through the outage"
            b = client.get_batch(step, timeout_s=120)
            errors += _check_answered(b.groups)
            step += 1
        counters = client.metrics()["counters"]
        assert counters.get("dropped", 0) == 0, counters  # nothing thrown away, nothing trained half-searched
        assert counters["issued"] >= issued

        retriever.max_outage_s = 1.0  # the second outage outlasts its budget: the worker fails naming the URL
        retrieval.stop()
        thread.join(timeout=90)
        assert not thread.is_alive(), "the worker outlived an outage past agentloop.tool.max_outage_s"
        err = result.get("error")
        assert isinstance(err, RetrieverOutageError), repr(err)
        assert retrieve_url in str(err) and "agentloop.tool.max_outage_s" in str(err)
    finally:
        client.close()
        broker.stop()
        retrieval.stop()
        engine.stop()
        thread.join(timeout=30)
