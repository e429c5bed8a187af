"""The embedded default in cluster shapes: two actor ranks whose leader works alone for longer than the
collective timeout, and two torchrun nodes on one host (actor on node 0, rollout on node 1, as
``configs/searchr1.toml``). Asserts on metrics.jsonl, TensorBoard and process lists, not on logs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from proc_helpers import TRAIN, assert_nothing_left, free_port, read_metrics, run_job, tiny_env, tiny_overrides

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_leader_phase_longer_than_the_collective_timeout_completes(prepared, tmp_path):
    """Two actor ranks on gloo with a 6 s collective timeout. Actor rank 0 works alone for 10 s in its first
    batch phase (a slow sample filter) and for the before/after evals; rank 1 waits on the store, not in a
    collective. Before: rank 1 waited in a broadcast with ``cluster.store_timeout_s`` as its deadline and
    the job failed. The before/after eval (``eval.max_samples`` prompts) lands in metrics.jsonl and TensorBoard."""
    run_dir = tmp_path / "run"
    r = run_job(
        prepared,
        run_dir,
        'cluster.component_placement={ actor = "0-1", "rollout,reward" = "2" }',
        "cluster.num_devices_per_node=3",
        "cluster.actor_collective_timeout_s=6",
        "runner.max_steps=2",
        "runner.async_mode=false",
        "runner.eval_before_after=true",
        "eval.max_samples=6",
        'rollout_buffer.sample_filter_path="slow_filter:slow_first_batch"',
        nproc=3,
        env=tiny_env(ASYNCRL_TEST_SLOW_FILTER_S="10"),
        timeout_s=600,
    )
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-6000:]}"
    assert_nothing_left(run_dir, within_s=10)
    recs = read_metrics(run_dir)
    steps = [x for x in recs if "time/step" in x]
    assert [x["step"] for x in steps] == [1, 2]
    assert steps[0]["time/step"] > 10  # the leader's phase did outlast the collective timeout
    evals = [x for x in recs if "eval/test/accuracy" in x]
    assert [x["step"] for x in evals] == [0, 2]  # before the first and after the last step
    for x in evals:
        assert x["eval/test/num_prompts"] == 6 and 0.0 <= x["eval/test/accuracy"] <= 1.0 and x["eval/time_seconds"] > 0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/test/accuracy")] == [0, 2]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["test_accuracy_before"] == evals[0]["eval/test/accuracy"]


def _agent(
    node_args: list[str], endpoint: str, rdzv_id: str, args: list[str], env: dict, log: Path
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        rdzv_id,
        "--max-restarts",
        "0",
        *node_args,
        str(TRAIN),
        "configs/tiny.toml",
        *args,
    ]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _run_two_nodes(args: list[str], tmp: Path, name: str, timeout_s: float) -> list[str]:
    """Two torchrun agents (``--nnodes 2``, c10d rendezvous on 127.0.0.1); both must exit 0. Their outputs."""
    endpoint, rdzv_id, env = f"127.0.0.1:{free_port()}", f"asyncrl-{uuid.uuid4().hex[:8]}", tiny_env()
    logs = [tmp / f"{name}-agent{i}.log" for i in range(2)]
    agents = [_agent([], endpoint, rdzv_id, args, env, logs[i]) for i in range(2)]
    deadline = time.monotonic() + timeout_s
    try:
        for a in agents:
            a.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, 9)
                a.wait(timeout=30)
    outs = [p.read_text() for p in logs]
    for a, out in zip(agents, outs):
        assert a.returncode == 0, out[-6000:]
    return outs


@pytest.mark.slow
def test_two_nodes_on_one_host_train_and_exit_clean(prepared, tmp_path):
    """``searchr1.toml``'s shape at the embedded default's size: node 0 = the actor (+ broker), node 1 = the
    rollout (CPU engine + agent worker); the broker's address reaches node 1, every process exits."""
    run_dir = tmp_path / "run"
    args = tiny_overrides(
        prepared,
        run_dir,
        "cluster.num_nodes=2",
        "cluster.num_devices_per_node=1",
        "runner.max_steps=3",
        "runner.eval_before_after=false",
    )
    outs = _run_two_nodes([*args, "--dry-run"], tmp_path, "dry", timeout_s=180)
    plans = "\n".join(outs)
    assert (
        "# this node: node 0, 1 ranks, roles actor" in plans and "# this node: node 1, 1 ranks, roles rollout" in plans
    )
    outs = _run_two_nodes(args, tmp_path, "run", timeout_s=480)
    assert_nothing_left(run_dir, within_s=10)
    recs = read_metrics(run_dir)
    assert [x["step"] for x in recs] == [1, 2, 3]
    assert recs[-1]["actor/weight_version"] == 3 and all(x["reward/mean"] >= 0 for x in recs)
    last = recs[-1]
    assert last["broker/issued_groups"] == (
        last["broker/trained_groups"]
        + last["broker/dropped_groups"]
        + last["broker/held_groups"]
        + last["broker/reissued_groups"]
    )


def test_dry_run_for_node_rank_1_shows_its_roles_and_devices():
    """As torchrun sets the environment on node 1's first process of a 2 x 8 job. Before: only global rank 0
    printed a plan, so node 1 printed nothing."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(GROUP_RANK="1", RANK="8", LOCAL_RANK="0", WORLD_SIZE="16", LOCAL_WORLD_SIZE="8", GROUP_WORLD_SIZE="2")
    r = subprocess.run(
        [sys.executable, str(ROOT / "launch/train.py"), "configs/searchr1.toml", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    node = r.stdout.split("# this node: ", 1)[1]
    assert node.startswith("node 1, 8 ranks, roles rollout")
    rows = [line for line in node.splitlines()[2:] if line.strip()]
    assert len(rows) == 8
    for i, row in enumerate(rows):
        assert row.split()[:4] == [str(8 + i), "1", "rollout", f"cuda:{i}"], row
        assert f"engine {i} (SGLang server, TP 1)" in row
    env["GROUP_RANK"] = "2"  # a node the job does not have
    r = subprocess.run(
        [sys.executable, str(ROOT / "launch/train.py"), "configs/searchr1.toml", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "node rank 2" in r.stderr


@pytest.mark.slow
def test_unreachable_tool_url_fails_the_start_naming_url_and_role(prepared, tmp_path):
    """The HTTP retriever's URL answers nothing: the rollout rank's start-up check fails the job before any
    step, naming the URL and the rank (before: the trajectories aborted one by one, and the evals read 0)."""
    run_dir = tmp_path / "run"
    url = f"http://127.0.0.1:{free_port()}/retrieve"
    # runner.eval_before_after at tiny.toml's value (true): actor rank 0's eval checks the URL too
    r = run_job(
        prepared,
        run_dir,
        'agentloop.tool.retriever="http"',
        f'agentloop.tool.retriever_url="{url}"',
        "runner.max_steps=2",
        "runner.eval_before_after=true",
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert f"rollout rank 1 (engine 0): agentloop.tool.retriever_url {url} does not answer" in out, out[-4000:]
    assert_nothing_left(run_dir, within_s=10)
    assert not (run_dir / "metrics.jsonl").exists() or not read_metrics(run_dir)
