"""The Megatron actor at TP=2 (torchrun, gloo) syncs its weights into two CPU engines.

One torchrun launch (this file's ``__main__``, 2 ranks = one TP=2 actor) against two CPU engines
started by the test: for each pause mode (retract, in_place, drain) one training step on synthetic
groups, then a sync of ``actor.iter_hf_buckets`` (all ranks iterate; global rank 0 is rank 0 of the
weight-sync group, in a process that already has the actor's default group) while requests are in
flight. Afterwards each engine's log-probs for a fixed prompt must equal the actor's recomputed
log-probs within 1e-4 and its ``weight_version`` the actor's version.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODES = ("retract", "in_place", "drain")


def _worker(hf: str, out: str, urls: list[str]) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).parent))
    from sync_helpers import PROMPT
    from test_sync_cpu_engines import TIMEOUT_S, Traffic, _engine_logprobs, _versions

    from asyncrl.actor.megatron_actor import Actor
    from asyncrl.actor.synthetic import synthetic_groups, tiny_actor_config
    from asyncrl.config.schema import SyncConfig
    from asyncrl.engine.blocking import post_json
    from asyncrl.sync.group import EngineEndpoint, WeightSyncGroup
    from asyncrl.sync.weight_sync import SyncHooks, WeightSyncer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = tiny_actor_config(hf, actor={"tensor_model_parallel_size": 2})
    actor = Actor(cfg)
    vocab = json.loads((Path(hf) / "config.json").read_text())["vocab_size"]
    sync_cfg = SyncConfig(bucket_bytes=128 * 1024, backend="gloo", join_timeout_s=TIMEOUT_S, step_timeout_s=TIMEOUT_S)
    group = None
    if rank == 0:
        group = WeightSyncGroup([EngineEndpoint(u) for u in urls], sync_cfg, master_address="127.0.0.1")
        group.init()
    results = {}
    for i, mode in enumerate(MODES):
        actor.train_step(synthetic_groups(seed=i, num_groups=2, group_size=4, vocab_size=vocab) if rank == 0 else None)
        buckets = actor.iter_hf_buckets(sync_cfg.bucket_bytes)
        payload = [None]
        if rank == 0:
            traffic = Traffic(urls, per_engine=3, turns=2 if mode == "drain" else 1)

            hooks = SyncHooks(sync_begin=traffic.on_sync_begin, sync_end=lambda v, t=traffic: t.released.set())
            syncer = WeightSyncer(group, pause_mode=mode, sync_cfg=sync_cfg, hooks=hooks)
            traffic.start()
            traffic.wait_running(in_flight=mode != "drain")
            res = syncer.sync(buckets, version=actor.version)
            metas = traffic.join()
            if mode == "in_place":  # stale prefix KV of the fixed prompt survives an in_place sync
                for u in urls:
                    post_json(u, "/flush_cache", {}, timeout_s=10, step="flush_cache")
            payload = [
                {
                    "engines": [_engine_logprobs(u) for u in urls],
                    "metas": metas,
                    "num_buckets": res.num_buckets,
                    "num_bytes": res.num_bytes,
                }
            ]
        else:
            for _ in buckets:  # the TP peer takes part in gathering every bucket
                pass
        dist.broadcast_object_list(payload, src=0)
        got = payload[0]
        lps = actor.compute_logprobs([PROMPT + ids for ids, _, _ in got["engines"]], [len(PROMPT)] * len(urls))
        if rank == 0:
            results[mode] = {
                "version": actor.version,
                "max_diff": max(
                    (lp - torch.tensor(e_lps)).abs().max().item() for (lp, _), (_, e_lps, _) in zip(lps, got["engines"])
                ),
                "engine_versions": [m["weight_versions"] for _, _, m in got["engines"]],
                "retractions": [m["num_retractions"] for m in got["metas"]],
                "splits": [_versions(m) for m in got["metas"]],
                "num_buckets": got["num_buckets"],
            }
    if rank == 0:
        group.destroy()
        Path(out).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_actor_tp2_sync_into_two_cpu_engines(tmp_path):
    from asyncrl.cpu_engine.testing import running_cpu_engine
    from asyncrl.models.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf", num_hidden_layers=2, vocab_size=1000)
    out = tmp_path / "out.json"
    extra = ["--weight-sync-timeout-s", "60"]
    with (
        running_cpu_engine(hf, log_dir=tmp_path / "logs", weight_version="0", extra=extra) as e1,
        running_cpu_engine(hf, log_dir=tmp_path / "logs", weight_version="0", extra=extra) as e2,
    ):
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
        proc = subprocess.run(
            [*cmd, str(hf), str(out), e1.url, e2.url], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
        )
    if proc.returncode != 0:
        errors = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "error" in ln][:20]
        pytest.fail("torchrun worker failed:\n" + "\n".join(errors) + "\n...\n" + proc.stderr[-3000:])
    r = json.loads(out.read_text())
    for v, mode in enumerate(MODES, start=1):
        m = r[mode]
        assert m["version"] == v
        assert m["num_buckets"] > 1
        assert m["max_diff"] < 1e-4, (mode, m["max_diff"])
        assert m["engine_versions"] == [[{"version": str(v), "start": 0, "end": 8}]] * 2
        split = [s for s in m["splits"] if len(s) > 1]
        if mode == "retract":
            assert any(n > 0 for n in m["retractions"])
            assert [str(v - 1), str(v)] in split
        elif mode == "in_place":
            assert all(n == 0 for n in m["retractions"]) and [str(v - 1), str(v)] in split
        else:
            assert not split and {s[0] for s in m["splits"]} == {str(v - 1), str(v)}


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3:])
