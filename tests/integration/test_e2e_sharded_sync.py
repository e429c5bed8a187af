"""End to end with ``sync.topology = "sharded"``: a TP=2 actor (two actor ranks) + one rollout rank with its CPU
engine, under torchrun. Each TP rank is rank 0 of its own weight-update group; the trainer forms both groups on
every actor rank, syncs every step, and logs the bytes through actor rank 0 (``sync/rank0_bytes``), which at TP = 2
is about the model's size (half its gather, half its broadcast) where the broadcast topology moves twice that."""

from __future__ import annotations

import pytest
from proc_helpers import assert_nothing_left, read_metrics, run_job


@pytest.mark.slow
def test_sharded_sync_in_a_tp2_run(prepared, tmp_path):
    run_dir = tmp_path / "run"
    r = run_job(
        prepared,
        run_dir,
        'cluster.component_placement={ actor = "0-1", "rollout,reward" = "2" }',
        "cluster.num_devices_per_node=3",
        "actor.tensor_model_parallel_size=2",
        'sync.topology="sharded"',
        "sync.verify_interval=1",
        "runner.max_steps=2",
        "runner.async_mode=false",
        nproc=3,
        timeout_s=600,
    )
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-6000:]}"
    assert_nothing_left(run_dir, within_s=10)
    steps = [x for x in read_metrics(run_dir) if "time/step" in x]
    assert [x["step"] for x in steps] == [1, 2]
    assert [x["actor/weight_version"] for x in steps] == [1, 2]
    for x in steps:
        total = x["sync/num_bytes"]
        assert total > 0 and x["time/sync_weights"] > 0
        assert 0.4 * total <= x["sync/rank0_bytes"] <= 1.1 * total, x  # the broadcast topology: >= 2 x total
        assert x["sync/bytes_max_rank"] <= 1.1 * total
