"""Weight-sync bandwidth: a full sync into 1 and 2 CPU engines vs a bare gloo broadcast.

For a model of a given size (a random Qwen2-architecture checkpoint made on the spot), measures
  * sync:  ``WeightSyncer.sync`` end to end (pause, begin, bucketed broadcasts paired with
           ``/update_weights_from_distributed`` and the engines' weight loads, version bump, end,
           flush, continue) into N real CPU engine processes over the gloo weight-sync group;
  * bare:  the same tensors, in the same buckets and order, broadcast from rank 0 over a gloo
           group of the same size formed the same way (TCPStore + PrefixStore), between the
           trainer and N plain receiver processes that only allocate and receive (the limit);
and reports bytes/s of each and their ratio (target >= 0.8). The receivers are separate processes
of the same count on the same host (the engine processes expose no bare-broadcast hook).

    python benchmarks/weight_sync_bench.py --quick
    python benchmarks/weight_sync_bench.py --hidden-size 1024 --layers 8 --reps 5

The last stdout line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from asyncrl.config.schema import SyncConfig  # noqa: E402
from asyncrl.sync import process_group as pgmod  # noqa: E402
from asyncrl.sync.bucketing import bucket_meta, dtype_from_name, flat_nbytes, flatten_bucket, iter_buckets  # noqa: E402
from asyncrl.sync.group import EngineEndpoint, WeightSyncGroup, free_port  # noqa: E402
from asyncrl.sync.weight_sync import WeightSyncer  # noqa: E402

TIMEOUT_S = 120.0


def _receiver(args_path: str) -> int:
    """Bare receiver: join the group as ``rank`` and receive every bucket ``reps`` times."""
    a = json.loads(Path(args_path).read_text())
    torch.set_num_threads(1)
    pg = pgmod.init_weight_update_group(
        "127.0.0.1", a["port"], a["rank"], a["world"], "bench_bare", backend="gloo", timeout_s=TIMEOUT_S
    )
    for _ in range(a["reps"]):
        for b in a["buckets"]:
            if a["flattened"]:
                buf = torch.empty(b["nbytes"], dtype=torch.uint8)
                dist.broadcast(buf, group_src=0, group=pg)
            else:
                for shape, dt in zip(b["shapes"], b["dtypes"]):
                    t = torch.empty(shape, dtype=dtype_from_name(dt))
                    dist.broadcast(t, group_src=0, group=pg)
        dist.all_reduce(torch.zeros(1), group=pg)  # end-of-rep fence: everyone has everything
    pgmod.destroy_weight_update_group(pg)
    return 0


class _BareGroup:
    """Rank 0 of a gloo group with ``n`` plain receiver processes (the bare-broadcast limit)."""

    def __init__(self, buckets, n: int, reps: int, flattened: bool, tmp: Path):
        self.buckets, self.flattened = buckets, flattened
        port = free_port("127.0.0.1")
        metas = [bucket_meta(b) for b in buckets]
        self.procs = []
        for r in range(1, n + 1):
            p = tmp / f"recv{n}_{r}.json"
            p.write_text(
                json.dumps(
                    {
                        "port": port,
                        "rank": r,
                        "world": n + 1,
                        "reps": reps,
                        "flattened": flattened,
                        "buckets": [
                            {"shapes": [list(s) for s in m.shapes], "dtypes": list(m.dtypes), "nbytes": flat_nbytes(m)}
                            for m in metas
                        ],
                    }
                )
            )
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--receiver", str(p)], env={**os.environ, "OMP_NUM_THREADS": "1"}
                )
            )
        self.pg = pgmod.init_weight_update_group(
            "127.0.0.1", port, 0, n + 1, "bench_bare", backend="gloo", timeout_s=TIMEOUT_S
        )

    def rep(self) -> float:
        """Seconds for one broadcast of every bucket, up to the fence where all receivers have it."""
        t0 = time.perf_counter()
        for b in self.buckets:
            tensors = [flatten_bucket(b)] if self.flattened else [t.contiguous() for _, t in b]
            for t in tensors:
                dist.broadcast(t, group_src=0, group=self.pg)
        dist.all_reduce(torch.zeros(1), group=self.pg)
        return time.perf_counter() - t0

    def close(self) -> None:
        try:
            pgmod.destroy_weight_update_group(self.pg)
            for p in self.procs:
                if p.wait(TIMEOUT_S) != 0:
                    raise RuntimeError(f"bare receiver pid {p.pid} exited with {p.returncode}")
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)


def _measure(sups, state, buckets, sync_cfg: SyncConfig, reps: int, tmp: Path) -> dict[str, list[float]]:
    """Alternate one full sync into the engines ``sups`` and one bare broadcast to as many plain
    receivers, ``reps`` times (alternating keeps both under the same background load)."""
    n = len(sups)
    group = WeightSyncGroup(
        [EngineEndpoint(s.url) for s in sups], sync_cfg, master_address="127.0.0.1", control_timeout_s=TIMEOUT_S
    )
    group.init()
    bare = _BareGroup(buckets, n, reps + 1, sync_cfg.flattened_bucket, tmp)
    out: dict[str, list[float]] = {"sync": [], "transfer": [], "bare": []}
    try:
        syncer = WeightSyncer(group, pause_mode="retract", sync_cfg=sync_cfg)
        syncer.sync(iter_buckets(state.items(), sync_cfg.bucket_bytes), version="warmup")
        bare.rep()  # warm-up
        for i in range(reps):
            r = syncer.sync(iter_buckets(state.items(), sync_cfg.bucket_bytes), version=i + 1)
            out["sync"].append(r.time_s)
            out["transfer"].append(r.transfer_s)
            out["bare"].append(bare.rep())
        return out
    finally:
        bare.close()
        group.destroy()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~110 MB model, 5 reps (< 60 s)")
    ap.add_argument("--hidden-size", type=int, default=768)
    ap.add_argument("--intermediate-size", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--bucket-mib", type=float, default=512.0, help="sync.bucket_bytes in MiB")
    ap.add_argument("--flattened", action="store_true", help="sync.flattened_bucket = true")
    ap.add_argument("--engines", default="1,2", help="comma-separated engine counts")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--receiver", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.receiver:
        return _receiver(a.receiver)
    if a.quick:
        a.hidden_size, a.intermediate_size, a.layers, a.reps = 768, 2048, 4, 5

    from asyncrl.models.tiny import make_tiny_checkpoint
    from asyncrl.models.torch_decoder import TorchDecoder
    from asyncrl.rollout.testing import running_cpu_engine

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    counts = [int(x) for x in a.engines.split(",")]
    sync_cfg = SyncConfig(
        bucket_bytes=int(a.bucket_mib * (1 << 20)),
        flattened_bucket=a.flattened,
        backend="gloo",
        join_timeout_s=TIMEOUT_S,
        step_timeout_s=TIMEOUT_S,
    )
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ckpt = make_tiny_checkpoint(
            tmp / "model",
            arch="qwen2",
            seed=0,
            hidden_size=a.hidden_size,
            intermediate_size=a.intermediate_size,
            num_hidden_layers=a.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
        )
        state = {k: v.detach() for k, v in TorchDecoder.from_pretrained(ckpt).state_dict().items()}
        model_bytes = sum(t.numel() * t.element_size() for t in state.values())
        buckets = list(iter_buckets(state.items(), sync_cfg.bucket_bytes))
        results = []
        import contextlib

        with contextlib.ExitStack() as stack:
            sups = [
                stack.enter_context(
                    running_cpu_engine(
                        ckpt,
                        log_dir=tmp / "logs",
                        max_running_requests=4,
                        weight_version="0",
                        extra=["--weight-sync-timeout-s", str(TIMEOUT_S), "--num-threads", "1"],
                    )
                )
                for _ in range(max(counts))
            ]
            for n in counts:
                t = _measure(sups[:n], state, buckets, sync_cfg, a.reps, tmp)
                s_whole, s_transfer, s_bare = (statistics.median(t[k]) for k in ("sync", "transfer", "bare"))
                results.append(
                    {
                        "engines": n,
                        "sync_s": s_whole,
                        "sync_transfer_s": s_transfer,
                        "bare_broadcast_s": s_bare,
                        "sync_bytes_per_s": model_bytes / s_whole,
                        "sync_transfer_bytes_per_s": model_bytes / s_transfer,
                        "bare_bytes_per_s": model_bytes / s_bare,
                        "ratio": s_bare / s_whole,
                        "transfer_ratio": s_bare / s_transfer,
                        "sync_reps_s": t["sync"],
                        "bare_reps_s": t["bare"],
                    }
                )
                print(
                    f"engines={n}: sync {s_whole * 1e3:.1f} ms ({model_bytes / s_whole / 1e6:.0f} MB/s), "
                    f"bare broadcast {s_bare * 1e3:.1f} ms ({model_bytes / s_bare / 1e6:.0f} MB/s), "
                    f"ratio {s_bare / s_whole:.2f}",
                    flush=True,
                )
    out = {
        "benchmark": "weight_sync_bench",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "model_bytes": model_bytes,
        "num_tensors": len(state),
        "num_buckets": len(buckets),
        "bucket_bytes": sync_cfg.bucket_bytes,
        "flattened_bucket": a.flattened,
        "reps": a.reps,
        "backend": "gloo",
        "target_ratio": 0.8,
        "results": results,
        "min_ratio": min(r["ratio"] for r in results),
        "wall_s": time.perf_counter() - t_start,
        "load_avg_1m": os.getloadavg()[0],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
