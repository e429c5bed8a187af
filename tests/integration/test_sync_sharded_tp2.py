"""Sharded weight sync (``sync.topology = "sharded"``): a TP=2 Megatron actor (torchrun, gloo) into two CPU engines.

One torchrun launch (this file's ``__main__``, 2 ranks = one TP=2 actor) against two CPU engines started by the test:
1. the broadcast topology (today's: rank 0 all-gathers and broadcasts everything), ``REPEATS`` syncs, timed;
2. the sharded topology on the same engines: each TP rank is rank 0 of its own weight-update group, ``REPEATS``
   syncs, timed; each rank's bytes as counted while sending must equal the plan's, and rank 0's must be at most
   0.6 of the broadcast topology's (1/2 expected at TP = 2);
3. a training step, a sharded sync, then EVERY tensor the actor holds (its full HF export) read back from both
   engines (``/get_weights_by_name``, all rows) must be bit-identical;
4. an engine is SIGKILLed IN a sync, while sender 1 (not the leader) owns the bucket in flight: every actor rank
   stops at that bucket, the recovery waits for its restart (the test relaunches it and publishes the count, as a
   rollout rank does), re-forms both senders' groups and the retry leaves EVERY tensor bit-identical on both
   engines, at the new version, in seconds.
One launch does all four (one actor, one pair of engines: the suite's time).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sharded_helpers import TIMEOUT_S, bcast, gather, run_torchrun_worker, served_equal

REPEATS = int(os.environ.get("ASYNCRL_SHARDED_REPEATS", "3"))


def _wait_file(path: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout_s:g} s")
        time.sleep(0.05)
    return path.read_text()


def _killing_source(actor, flags: Path):
    """The actor's ``ShardSource`` that, once ``armed``, has the test kill engine 2 on the leader before the second
    bucket of sender 1 is gathered (sender 1 owns the bucket in flight)."""
    import torch.distributed as dist

    from asyncrl.actor.shard_source import ShardSource

    class _KillsUnderSender1(ShardSource):
        armed, seen = False, 0

        def gather(self, bucket, *, owner):
            if self.armed and bucket.owner == 1:
                self.seen += 1
            if self.armed and self.seen == 2 and dist.get_rank() == 0:
                self.armed = False
                (flags / "kill").write_text("1")
                _wait_file(flags / "killed", TIMEOUT_S)
            return super().gather(bucket, owner=owner)

    return _KillsUnderSender1(actor)


def _worker(hf: str, out: str, flags: str, urls: list[str]) -> None:
    import torch.distributed as dist

    from asyncrl.actor.megatron_actor import Actor
    from asyncrl.actor.shard_source import param_metas
    from asyncrl.actor.synthetic import synthetic_groups, tiny_actor_config
    from asyncrl.config.schema import SyncConfig
    from asyncrl.sync.group import EngineEndpoint, WeightSyncGroup
    from asyncrl.sync.recovery import EngineRecovery, sync_weights
    from asyncrl.sync.shard_plan import rank_bytes
    from asyncrl.sync.sharded import ShardedSync, funnel_bytes, sync_weights_sharded
    from asyncrl.sync.weight_sync import WeightSyncer

    dist.init_process_group("gloo")
    rank, flag_dir = dist.get_rank(), Path(flags)
    cfg = tiny_actor_config(hf, actor={"tensor_model_parallel_size": 2})
    actor = Actor(cfg)
    vocab = json.loads((Path(hf) / "config.json").read_text())["vocab_size"]
    sync_cfg = SyncConfig(
        bucket_bytes=256 * 1024, backend="gloo", join_timeout_s=TIMEOUT_S, step_timeout_s=TIMEOUT_S, verify_interval=1
    )
    engines = [EngineEndpoint(u) for u in urls]
    r: dict = {"broadcast": [], "sharded": []}

    # 1. the broadcast topology
    syncer = None
    if rank == 0:
        group = WeightSyncGroup(engines, sync_cfg, master_address="127.0.0.1", control_timeout_s=TIMEOUT_S)
        group.init()
        syncer = WeightSyncer(group, pause_mode="retract", sync_cfg=sync_cfg)
    for _ in range(REPEATS):
        res = sync_weights(actor, syncer, None, bucket_bytes=sync_cfg.bucket_bytes, is_leader=rank == 0, bcast=bcast)
        if rank == 0:
            r0, mx = funnel_bytes(
                param_metas(actor.model, actor.spec, tp=actor.tp), tp=actor.tp, num_bytes=res.num_bytes
            )
            r["broadcast"].append(
                {"time_s": res.time_s, "rank0_bytes": r0, "max_rank_bytes": mx, "bytes": res.num_bytes}
            )
    if rank == 0:
        group.destroy()

    # 2. the sharded topology on the same engines
    lead = None
    if rank == 0:
        base = WeightSyncGroup(engines, sync_cfg, master_address="127.0.0.1", control_timeout_s=TIMEOUT_S)
        lead = WeightSyncer(base, pause_mode="retract", sync_cfg=sync_cfg)
    source = _killing_source(actor, flag_dir)
    sharded = ShardedSync(source, sync_cfg, bcast=bcast, syncer=lead)
    sharded.form()
    planned = rank_bytes(sharded.source.metas, sharded.plan, tp=actor.tp)
    counted = []
    for _ in range(REPEATS):
        res = sync_weights_sharded(sharded, None, bcast=bcast)
        counted.append(sharded.bytes_moved())
        if rank == 0:
            r["sharded"].append(
                {
                    "time_s": res.time_s,
                    "rank0_bytes": res.rank0_bytes,
                    "max_rank_bytes": res.max_rank_bytes,
                    "bytes": res.num_bytes,
                    "verified": res.verify.checked,
                }
            )
    r["counted"] = gather(counted)
    r["planned"] = planned
    r["owners"] = sorted(set(b.owner for b in sharded.plan.buckets))

    # 3. train, sync, compare every tensor
    actor.train_step(synthetic_groups(seed=1, num_groups=2, group_size=4, vocab_size=vocab) if rank == 0 else None)
    res = sync_weights_sharded(sharded, None, bcast=bcast)
    r["compared_after_train"] = served_equal(actor, urls)
    r["version_after_train"] = res.version if rank == 0 else None

    # 4. an engine dies in a sync, under sender 1's bucket; the recovery re-forms both groups once it restarted
    recovery = None
    if rank == 0:
        counts = flag_dir / "restarts"
        recovery = EngineRecovery(
            lead.group,
            read_restarts=lambda i: int(counts.read_text()) if i == 1 and counts.exists() else 0,
            publish_synced=lambda i, n: None,
            wait_s=TIMEOUT_S,
            max_failures=2,
        )
    actor.train_step(synthetic_groups(seed=2, num_groups=2, group_size=4, vocab_size=vocab) if rank == 0 else None)
    source.armed = True
    t0 = time.monotonic()
    res = sync_weights_sharded(sharded, recovery, bcast=bcast)
    took = time.monotonic() - t0
    r["compared_after_restart"] = served_equal(actor, urls)
    if rank == 0:
        r["version_after_restart"] = res.version
        r["failures"] = recovery.failures
        r["actor_version"] = actor.version
        r["killed_mid_sync"] = not source.armed
        r["took_s"] = took
        sharded.destroy()
        Path(out).write_text(json.dumps(r, indent=1))
    else:
        sharded.destroy()
    dist.barrier()
    dist.destroy_process_group()


def _play_the_rollout_rank(proc: subprocess.Popen, victim, flags: Path) -> None:
    """When the worker asks: SIGKILL the victim engine, say so, relaunch it and publish its restart count."""
    deadline = time.monotonic() + 240
    while not (flags / "kill").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            return
        time.sleep(0.05)
    os.kill(victim.pid, signal.SIGKILL)
    victim.child.popen.wait(timeout=30)
    (flags / "killed").write_text("1")
    victim.relaunch("killed by the test")
    victim.wait_ready()
    (flags / "restarts").write_text(str(victim.restarts))


@pytest.mark.slow
def test_sharded_sync_tp2_two_engines(tmp_path):
    from asyncrl.models.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf", arch="llama", num_hidden_layers=2, vocab_size=1000)
    r = _run_worker(tmp_path, hf, "main")
    print(json.dumps({k: r[k] for k in ("broadcast", "sharded", "planned", "counted")}, indent=1))
    b0 = statistics.median(x["rank0_bytes"] for x in r["broadcast"])
    s0 = statistics.median(x["rank0_bytes"] for x in r["sharded"])
    assert r["owners"] == [0, 1]  # both TP ranks send
    assert s0 <= 0.6 * b0, (s0, b0)  # ~1/2 at TP = 2
    assert max(x["max_rank_bytes"] for x in r["sharded"]) <= 0.6 * b0
    assert all(c == r["planned"] for c in map(list, zip(*r["counted"])))  # each rank moved what the plan says
    assert all(x["bytes"] == r["broadcast"][0]["bytes"] for x in r["broadcast"] + r["sharded"])  # the whole model
    assert all(x["verified"] > 0 for x in r["sharded"])
    assert r["compared_after_train"] > 10 and r["compared_after_restart"] == r["compared_after_train"]
    assert r["version_after_train"] == "1" and r["version_after_restart"] == "2" == str(r["actor_version"])
    assert r["killed_mid_sync"] and r["failures"] == 1  # the sync failed once, in flight; the retry went through
    assert r["took_s"] < 50, r  # no wait for a 600 s timeout anywhere


def _run_worker(tmp_path, hf, mode: str) -> dict:
    """The torchrun worker ``mode`` against two fresh CPU engines, playing the rollout rank for engine 2."""
    from asyncrl.cpu_engine.testing import running_cpu_engine

    out, flags = tmp_path / f"{mode}.json", tmp_path / f"flags_{mode}"
    flags.mkdir()
    extra = ["--weight-sync-timeout-s", "10"]  # a survivor's receive of the lost bucket gives up after 10 s
    with (
        running_cpu_engine(hf, log_dir=tmp_path / "logs", extra=extra) as e1,
        running_cpu_engine(hf, log_dir=tmp_path / "logs", extra=extra) as e2,
    ):
        e2.max_restarts = 1
        run_torchrun_worker(
            __file__,
            [mode, str(hf), str(out), str(flags), e1.url, e2.url],
            tmp_path / f"{mode}.log",
            timeout_s=300,
            meanwhile=lambda proc: _play_the_rollout_rank(proc, e2, flags),
        )
    return json.loads(out.read_text())


if __name__ == "__main__":
    assert sys.argv[1] == "main", sys.argv
    _worker(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
