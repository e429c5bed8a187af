"""Shared parts of the sharded weight-sync tests (``test_sync_sharded_*.py``): the object collectives their torchrun
workers use, the served-weights read-back, the broadcast-then-sharded measurement on one actor, and the torchrun
launch of a worker.

Real parts: the workers run real Megatron actors over gloo against real CPU engines; nothing here stands in for one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import median
from typing import Any, Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60.0


def bcast(obj):
    """Actor rank 0's ``obj`` on every rank."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(x) -> list:
    """Every rank's ``x``, in rank order, on every rank."""
    import torch.distributed as dist

    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, x)
    return got


def served_equal(actor, urls: list[str]) -> int:
    """Every tensor of the actor's full HF export against each engine, bit for bit (collective: every rank
    iterates the export; rank 0 compares). The number of tensors compared (0 elsewhere)."""
    import torch
    import torch.distributed as dist

    from asyncrl.engine.blocking import post_json

    full = {n: t.clone() for b in actor.iter_hf_buckets(1 << 20) for n, t in b}
    if dist.get_rank() != 0:
        return 0
    for url in urls:
        for name, t in full.items():
            got = post_json(
                url,
                "/get_weights_by_name",
                {"name": name, "truncate_size": t.shape[0]},
                timeout_s=TIMEOUT_S,
                step="get_weights_by_name",
            )
            served = torch.tensor(got, dtype=torch.float32)
            assert served.shape == t.shape, (url, name, served.shape, t.shape)
            assert torch.equal(served, t.float()), f"engine {url} serves {name} different from the actor's"
    return len(full)


def broadcast_then_sharded(actor, urls: Sequence[str], sync_cfg, *, repeats: int, rank0_metas: Callable[[], list]):
    """On every actor rank: ``repeats`` syncs of the broadcast topology (then its group is destroyed), the sharded
    topology formed on the same engines and ``repeats`` syncs of it, each sync moving the same bytes. Returns
    ``(record, sharded, source, res)``: ``record`` holds ``broadcast`` (rank 0: median time, rank-0 and busiest-rank
    bytes from ``rank0_metas()``, the model's bytes), ``sharded`` (rank 0: the same from the last sharded sync, with
    its read-back and version), ``counted`` (each rank's bytes as moved) and ``planned`` (the plan's)."""
    import torch.distributed as dist

    from asyncrl.actor.shard_source import ShardSource
    from asyncrl.sync.group import EngineEndpoint, WeightSyncGroup
    from asyncrl.sync.recovery import sync_weights
    from asyncrl.sync.shard_plan import rank_bytes
    from asyncrl.sync.sharded import ShardedSync, funnel_bytes, sync_weights_sharded
    from asyncrl.sync.weight_sync import WeightSyncer

    lead0 = dist.get_rank() == 0
    engines = [EngineEndpoint(u) for u in urls]
    r: dict[str, Any] = {}
    syncer = group = None
    if lead0:
        group = WeightSyncGroup(engines, sync_cfg, master_address="127.0.0.1", control_timeout_s=TIMEOUT_S)
        group.init()
        syncer = WeightSyncer(group, pause_mode="retract", sync_cfg=sync_cfg)
    times = []
    for _ in range(repeats):
        res = sync_weights(actor, syncer, None, bucket_bytes=sync_cfg.bucket_bytes, is_leader=lead0, bcast=bcast)
        times.append(res.time_s if lead0 else 0.0)
    if lead0:
        r0, mx = funnel_bytes(rank0_metas(), tp=actor.tp, num_bytes=res.num_bytes)
        r["broadcast"] = {"time_s": median(times), "rank0_bytes": r0, "max_rank_bytes": mx, "bytes": res.num_bytes}
        group.destroy()

    lead = None
    if lead0:
        base = WeightSyncGroup(engines, sync_cfg, master_address="127.0.0.1", control_timeout_s=TIMEOUT_S)
        lead = WeightSyncer(base, pause_mode="retract", sync_cfg=sync_cfg)
    source = ShardSource(actor)
    sharded = ShardedSync(source, sync_cfg, bcast=bcast, syncer=lead)
    sharded.form()
    times, counted = [], []
    for _ in range(repeats):
        res = sync_weights_sharded(sharded, None, bcast=bcast)
        times.append(res.time_s if lead0 else 0.0)
        counted.append(sharded.bytes_moved())
    assert len(set(counted)) == 1, counted  # every sync moves the same bytes
    r["counted"] = gather(counted[0])
    r["planned"] = rank_bytes(source.metas, sharded.plan, tp=actor.tp)
    if lead0:
        r["sharded"] = {
            "time_s": median(times),
            "rank0_bytes": res.rank0_bytes,
            "max_rank_bytes": res.max_rank_bytes,
            "bytes": res.num_bytes,
            "verified": res.verify.checked,
            "unsupported": res.verify.unsupported,
            "version": res.version,
        }
    return r, sharded, source, res


def run_torchrun_worker(
    script: str,
    args: Sequence[str],
    log: Path,
    *,
    nproc: int = 2,
    timeout_s: float = 240,
    meanwhile: Optional[Callable[[subprocess.Popen], None]] = None,
) -> None:
    """``torchrun --standalone --nproc_per_node=nproc script *args`` in its own session, output to ``log``;
    ``meanwhile(proc)`` runs while it does (a test's part, e.g. the rollout rank's); killed with its group past
    ``timeout_s``; a non-zero exit fails the test with the log's tail."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script]
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [*cmd, *args], env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
        )
        try:
            if meanwhile is not None:
                meanwhile(proc)
            proc.wait(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if proc.returncode != 0:
        pytest.fail("torchrun worker failed:\n" + log.read_text()[-4000:])
