"""Funnel vs sharded weight sync, side by side: a TP = 2 Megatron actor (torchrun, gloo, 2 ranks) into 2 CPU engines
(``--tp`` / ``--pp``: another layout, TP x PP ranks).

Both topologies' groups are formed once on the same engines (``sync.group_name`` for the broadcast topology,
``<group_name>.r0`` / ``.r1`` for the sharded one), then ``--repeats`` syncs of each, interleaved (broadcast, sharded,
sharded, broadcast, ...: the order alternates so a drift in the machine's load falls on both), every sync of the
same weights. Reports, per topology, the median and spread of the whole sync's seconds (``time/sync_weights``) and
the bytes through actor rank 0 (``sync/rank0_bytes``: its TP gather share + its broadcasts) and through the busiest
rank (``sync/bytes_max_rank``), with ``/proc/loadavg`` before and after (a 2-core machine shared with other work: the
times are only comparable within one run).

    python benchmarks/sync_sharded.py --quick      # 2 layers, hidden 256: ~1 min
    python benchmarks/sync_sharded.py              # 8 layers, hidden 512 (~110 MB fp32): about a minute
    python benchmarks/sync_sharded.py --tp 1 --pp 2   # the same model in two pipeline stages

The last stdout line is one JSON object with the figures (``--out`` also writes it to a file).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TIMEOUT_S = 120.0
SIZES = {  # make_tiny_checkpoint overrides
    "quick": dict(num_hidden_layers=2, hidden_size=256, intermediate_size=768, num_attention_heads=8,
                  num_key_value_heads=4),
    "default": dict(num_hidden_layers=8, hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                    num_key_value_heads=4),
}  # fmt: skip


def _bcast(obj):
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _worker(hf: str, out: str, repeats: int, tp: int, pp: int, urls: list[str]) -> None:
    import torch.distributed as dist

    from asyncrl.actor.megatron_actor import Actor
    from asyncrl.actor.shard_source import ShardSource, param_metas
    from asyncrl.actor.synthetic import tiny_actor_config
    from asyncrl.config.schema import SyncConfig
    from asyncrl.sync.group import EngineEndpoint, WeightSyncGroup
    from asyncrl.sync.recovery import sync_weights
    from asyncrl.sync.sharded import ShardedSync, funnel_bytes, sync_weights_sharded
    from asyncrl.sync.weight_sync import WeightSyncer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    actor = Actor(tiny_actor_config(hf, actor={"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp}))
    cfg = SyncConfig(bucket_bytes=32 << 20, backend="gloo", join_timeout_s=TIMEOUT_S, step_timeout_s=TIMEOUT_S)
    engines = [EngineEndpoint(u) for u in urls]
    funnel = lead = None
    if rank == 0:
        funnel = WeightSyncer(
            WeightSyncGroup(engines, cfg, master_address="127.0.0.1"), pause_mode="retract", sync_cfg=cfg
        )
        funnel.group.init()
        lead = WeightSyncer(
            WeightSyncGroup(engines, cfg, master_address="127.0.0.1"), pause_mode="retract", sync_cfg=cfg
        )
    sharded = ShardedSync(ShardSource(actor), cfg, bcast=_bcast, syncer=lead)
    sharded.form()
    metas = param_metas(actor.model, actor.spec, tp=actor.tp)
    runs: dict[str, list[dict]] = {"broadcast": [], "sharded": []}
    for i in range(repeats):
        order = ("broadcast", "sharded") if i % 2 == 0 else ("sharded", "broadcast")
        for topo in order:
            if topo == "broadcast":
                res = sync_weights(
                    actor, funnel, None, bucket_bytes=cfg.bucket_bytes, is_leader=rank == 0, bcast=_bcast
                )
                if res is not None:
                    r0, mx = funnel_bytes(metas, tp=actor.tp, num_bytes=res.num_bytes)
            else:
                res = sync_weights_sharded(sharded, None, bcast=_bcast)
                if res is not None:
                    r0, mx = res.rank0_bytes, res.max_rank_bytes
            if res is not None:
                runs[topo].append(
                    {"time_s": res.time_s, "rank0_bytes": r0, "max_rank_bytes": mx, "bytes": res.num_bytes}
                )
    sharded.destroy()
    if rank == 0:
        funnel.group.destroy()
        Path(out).write_text(json.dumps(runs))
    dist.barrier()
    dist.destroy_process_group()


def _summary(runs: list[dict]) -> dict:
    t = [r["time_s"] for r in runs]
    return {
        "time_s_median": statistics.median(t),
        "time_s_min": min(t),
        "time_s_max": max(t),
        "rank0_bytes": runs[0]["rank0_bytes"],
        "max_rank_bytes": runs[0]["max_rank_bytes"],
        "model_bytes": runs[0]["bytes"],
        "repeats": len(runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tp", type=int, default=2, help="the actor's TP size")
    ap.add_argument("--pp", type=int, default=1, help="the actor's pipeline stages")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from asyncrl.cpu_engine.testing import running_cpu_engine
    from asyncrl.models.tiny import make_tiny_checkpoint

    size = "quick" if args.quick else "default"
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    with tempfile.TemporaryDirectory(prefix="sync_sharded_") as tmp:
        d = Path(tmp)
        hf = make_tiny_checkpoint(d / "hf", arch="llama", vocab_size=4000, **SIZES[size])
        extra = ["--weight-sync-timeout-s", str(int(TIMEOUT_S))]
        with (
            running_cpu_engine(hf, log_dir=d / "logs", extra=extra) as e1,
            running_cpu_engine(hf, log_dir=d / "logs", extra=extra) as e2,
        ):
            env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
            ranks = args.tp * args.pp
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", __file__]
            t0 = time.monotonic()
            proc = subprocess.run(
                [
                    *cmd,
                    "--worker",
                    str(hf),
                    str(d / "out.json"),
                    str(args.repeats),
                    str(args.tp),
                    str(args.pp),
                    e1.url,
                    e2.url,
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=1800,
                cwd=REPO,
            )
            if proc.returncode != 0:
                sys.exit(f"torchrun worker failed:\n{proc.stderr[-4000:]}")
            runs = json.loads((d / "out.json").read_text())
    b, s = _summary(runs["broadcast"]), _summary(runs["sharded"])
    result = {
        "benchmark": "sync_sharded",
        "size": size,
        "command": " ".join(["python", "benchmarks/sync_sharded.py", *sys.argv[1:]]),
        "setup": f"TP={args.tp} x PP={args.pp} Megatron actor (torchrun, gloo, fp32) -> 2 CPU engines, bucket 32 MiB, "
        "pause retract",
        "broadcast": b,
        "sharded": s,
        "rank0_bytes_ratio": s["rank0_bytes"] / b["rank0_bytes"],
        "time_ratio_median": s["time_s_median"] / b["time_s_median"],
        "loadavg_before": load_before,
        "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
        "wall_s": time.monotonic() - t0,
    }
    line = json.dumps(result)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(line)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7:])
    else:
        main()
