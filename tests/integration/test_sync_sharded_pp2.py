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
import os
import signal
import subprocess
import sys
from pathlib import Path
from statistics import median

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60.0
REPEATS = 3  # syncs per topology: the times printed are medians


def _worker(hf: str, out: str, tp: int, urls: list[str]) -> None:
    """``tp``: the actor's TP (the test runs 1: 2 ranks; 2 needs 4 ranks)."""
    import torch.distributed as dist
    from test_sync_sharded_tp2 import _bcast, _gather, _served_equal  # the neighbour's helpers (same directory)

    from asyncrl.actor.megatron_actor import Actor
    from asyncrl.actor.shard_source import ShardSource, param_metas
    from asyncrl.actor.synthetic import synthetic_groups, tiny_actor_config
    from asyncrl.config.schema import SyncConfig
    from asyncrl.sync.group import EngineEndpoint, WeightSyncGroup
    from asyncrl.sync.recovery import sync_weights
    from asyncrl.sync.shard_plan import rank_bytes
    from asyncrl.sync.sharded import ShardedSync, funnel_bytes, sync_weights_sharded
    from asyncrl.sync.weight_sync import WeightSyncer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    actor = Actor(tiny_actor_config(hf, actor={"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": tp}))
    vocab = json.loads((Path(hf) / "config.json").read_text())["vocab_size"]
    sync_cfg = SyncConfig(
        bucket_bytes=64 * 1024, backend="gloo", join_timeout_s=TIMEOUT_S, step_timeout_s=TIMEOUT_S, verify_interval=1
    )
    engines = [EngineEndpoint(u) for u in urls]
    r: dict = {"stage": _gather(actor.pp_rank)}

    # 1. the broadcast topology: every byte through actor rank 0
    syncer = group = None
    if rank == 0:
        group = WeightSyncGroup(engines, sync_cfg, master_address="127.0.0.1", control_timeout_s=TIMEOUT_S)
        group.init()
        syncer = WeightSyncer(group, pause_mode="retract", sync_cfg=sync_cfg)
    times = []
    for _ in range(REPEATS):
        res = sync_weights(actor, syncer, None, bucket_bytes=sync_cfg.bucket_bytes, is_leader=rank == 0, bcast=_bcast)
        times.append(res.time_s if rank == 0 else 0.0)
    if rank == 0:
        stage0 = param_metas(actor.model, actor.spec, tp=actor.tp)  # what rank 0 holds (the funnel's model)
        r0, mx = funnel_bytes(stage0, tp=actor.tp, num_bytes=res.num_bytes)
        r["broadcast"] = {"time_s": median(times), "rank0_bytes": r0, "max_rank_bytes": mx, "bytes": res.num_bytes}
        group.destroy()

    # 2. the sharded topology: each stage sends its own parameters
    lead = None
    if rank == 0:
        base = WeightSyncGroup(engines, sync_cfg, master_address="127.0.0.1", control_timeout_s=TIMEOUT_S)
        lead = WeightSyncer(base, pause_mode="retract", sync_cfg=sync_cfg)
    source = ShardSource(actor)
    sharded = ShardedSync(source, sync_cfg, bcast=_bcast, syncer=lead)
    sharded.form()
    times, counted = [], []
    for _ in range(REPEATS):
        res = sync_weights_sharded(sharded, None, bcast=_bcast)
        times.append(res.time_s if rank == 0 else 0.0)
        counted.append(sharded.bytes_moved())
    assert len(set(counted)) == 1, counted  # every sync moves the same bytes
    r["counted"] = _gather(counted[0])
    r["planned"] = rank_bytes(source.metas, sharded.plan, tp=actor.tp)
    r["senders"] = sharded.senders
    r["owners"] = [b.owner for b in sharded.plan.buckets]
    local = {n for n, _ in actor.model.named_parameters()}
    r["metas_everywhere"] = _gather([(m.name, m.stage) for m in source.metas])
    r["own_stage_metas"] = _gather(sum(m.stage == actor.pp_rank for m in source.metas) == len(local))
    r["owner_stage_ok"] = all(sharded.plan.owners[m.name] // tp == m.stage for m in source.metas)
    if rank == 0:
        r["sharded"] = {
            "time_s": median(times),
            "rank0_bytes": res.rank0_bytes,
            "max_rank_bytes": res.max_rank_bytes,
            "bytes": res.num_bytes,
            "verified": res.verify.checked,
            "version": res.version,
        }

    # 3. train, sync, compare every tensor on both engines
    actor.train_step(synthetic_groups(seed=1, num_groups=2, group_size=4, vocab_size=vocab) if rank == 0 else None)
    res = sync_weights_sharded(sharded, None, bcast=_bcast)
    r["compared_after_train"] = _served_equal(actor, urls)
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
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
        with open(tmp_path / "worker.log", "w") as log:
            proc = subprocess.Popen(
                [*cmd, str(hf), str(out), "1", e1.url, e2.url],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,
            )
            try:
                proc.wait(timeout=240)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    if proc.returncode != 0:
        pytest.fail("torchrun worker failed:\n" + (tmp_path / "worker.log").read_text()[-4000:])
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
