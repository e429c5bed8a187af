"""Sharded weight sync with pipeline parallelism: a TP=1 x PP=2 Megatron actor (torchrun, gloo) into two CPU engines.

One torchrun launch (this file's ``__main__``, 2 ranks = the two stages of one pipeline) against two CPU engines:
1. the broadcast topology (stage 1 sends its tensors to actor rank 0, which broadcasts everything), ``REPEATS`` syncs,
   timed;
2. the sharded topology on the same engines: each stage's rank is rank 0 of its own weight-update group and sends
   only its own stage's parameters (the plan, identical on both ranks, owns every parameter within its stage),
   ``REPEATS`` syncs, timed;
   each rank's bytes as counted while sending equal the plan's, and rank 0's are below the broadcast topology's
   (there it receives stage 1's share and broadcasts the whole model; here it broadcasts stage 0's share only);
3. a training step, a sharded sync, then EVERY tensor of the actor's full HF export read back from both engines
   (``/get_weights_by_name``, all rows) must be bit-identical, at the new version.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from sharded_helpers import TIMEOUT_S, run_torchrun_worker

REPEATS = 3  # syncs per topology: the times printed are medians


def _worker(hf: str, out: str, tp: int, urls: list[str]) -> None:
    """``tp``: the actor's TP (the test runs 1: 2 ranks; 2 needs 4 ranks)."""
    import torch.distributed as dist
    from sharded_helpers import bcast, broadcast_then_sharded, gather, served_equal

    from asyncrl.actor.megatron_actor import Actor
    from asyncrl.actor.shard_source import param_metas
    from asyncrl.actor.synthetic import synthetic_groups, tiny_actor_config
    from asyncrl.config.schema import SyncConfig
    from asyncrl.sync.sharded import sync_weights_sharded

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    actor = Actor(tiny_actor_config(hf, actor={"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": tp}))
    vocab = json.loads((Path(hf) / "config.json").read_text())["vocab_size"]
    sync_cfg = SyncConfig(
        bucket_bytes=64 * 1024, backend="gloo", join_timeout_s=TIMEOUT_S, step_timeout_s=TIMEOUT_S, verify_interval=1
    )
    # 1. the broadcast topology: every byte through actor rank 0 (stage 0's metas: what rank 0 holds, the funnel's
    # model); 2. the sharded topology: each stage sends its own parameters
    r, sharded, source, _ = broadcast_then_sharded(
        actor,
        urls,
        sync_cfg,
        repeats=REPEATS,
        rank0_metas=lambda: param_metas(actor.model, actor.spec, tp=actor.tp),
    )
    r["stage"] = gather(actor.pp_rank)
    r["senders"] = sharded.senders
    r["owners"] = [b.owner for b in sharded.plan.buckets]
    local = {n for n, _ in actor.model.named_parameters()}
    r["metas_everywhere"] = gather([(m.name, m.stage) for m in source.metas])
    r["own_stage_metas"] = gather(sum(m.stage == actor.pp_rank for m in source.metas) == len(local))
    r["owner_stage_ok"] = all(sharded.plan.owners[m.name] // tp == m.stage for m in source.metas)

    # 3. train, sync, compare every tensor on both engines
    actor.train_step(synthetic_groups(seed=1, num_groups=2, group_size=4, vocab_size=vocab) if rank == 0 else None)
    res = sync_weights_sharded(sharded, None, bcast=bcast)
    r["compared_after_train"] = served_equal(actor, urls)
    sharded.destroy()
    if rank == 0:
        r["version_after_train"] = res.version
        r["actor_version"] = actor.version
        Path(out).write_text(json.dumps(r, indent=1))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_sync_pp2_each_stage_sends_its_own_parameters(tmp_path):
    from asyncrl.cpu_engine.testing import running_cpu_engine
    from asyncrl.models.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf", arch="llama", num_hidden_layers=2, vocab_size=1000)
    out = tmp_path / "out.json"
    with (
        running_cpu_engine(hf, log_dir=tmp_path / "logs") as e1,
        running_cpu_engine(hf, log_dir=tmp_path / "logs") as e2,
    ):
        run_torchrun_worker(__file__, [str(hf), str(out), "1", e1.url, e2.url], tmp_path / "worker.log")
    r = json.loads(out.read_text())
    print(json.dumps({k: r[k] for k in ("broadcast", "sharded", "planned", "counted", "owners")}, indent=1))
    b, s = r["broadcast"], r["sharded"]
    assert r["stage"] == [0, 1] and r["senders"] == [0, 1]  # stage s's (only) TP rank is sender s
    assert r["metas_everywhere"][0] == r["metas_everywhere"][1]  # both ranks plan from the whole model
    assert {st for _, st in r["metas_everywhere"][0]} == {0, 1} and all(r["own_stage_metas"])
    assert r["owner_stage_ok"] and sorted(set(r["owners"])) == [0, 1]  # both stages send, each its own
    assert r["counted"] == r["planned"]  # each rank moved what the plan says
    assert s["bytes"] == b["bytes"] and sum(r["planned"]) == b["bytes"]  # the whole model, each byte once
    assert s["rank0_bytes"] == r["planned"][0] < b["rank0_bytes"]  # below the funnel through rank 0
    assert s["max_rank_bytes"] == max(r["planned"]) < b["rank0_bytes"]
    assert s["verified"] > 0 and s["version"] == "0"
    assert r["compared_after_train"] > 10  # every tensor bit-identical on both engines
    assert r["version_after_train"] == "1" == str(r["actor_version"])


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:])
