"""Sharded weight sync with expert parallelism: a TP=1 x EP=2 Megatron actor on the tiny Qwen3-MoE (torchrun, gloo,
DP=2: each rank holds 4 of the 8 experts of every layer) into one CPU engine.

One torchrun launch (this file's ``__main__``, 2 ranks = the two EP ranks) against one CPU engine:
1. the broadcast topology (rank 1 broadcasts its experts to actor rank 0 over the EP group, which sends everything),
   ``REPEATS`` syncs, timed;
2. the sharded topology on the same engine: both EP ranks are senders, each rank 0 of its own weight-update group;
   every expert is owned by the rank that holds it, the dense parameters by either; the plan (identical on both
   ranks, built from both ranks' metas: all 8 experts of every layer) is sent, ``REPEATS`` syncs, timed; each rank's
   bytes as counted while sending equal the plan's, rank 0's are below the broadcast topology's;
3. a training step, then EP rank 1 scales its own experts by 1.5 (a change only a sync that carries EP rank 1's share
   can ship), a sharded sync: the engine (which refuses ``/get_weights_by_name`` for Qwen3-MoE, as SGLang does)
   must serve the actor's weights: its greedy ``/generate`` log-probs equal the actor's own log-probs of the same
   tokens (``compute_logprobs``), they differ before that sync, and the engine reports the new version.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from sharded_helpers import TIMEOUT_S, run_torchrun_worker

REPEATS = 3  # syncs per topology before the training step: the times printed are medians
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64, 128, 31, 9]
LP_TOL = 1e-4  # the engine's decode path against the actor's forward, both fp32 (the dense tests' assert_serves)


def _served_gap(actor, url: str) -> float:
    """Collective: rank 0 asks the engine for a greedy continuation of ``PROMPT`` with log-probs; every rank computes
    the actor's log-probs of those tokens. The largest difference (on every rank)."""
    import torch
    from sharded_helpers import bcast

    from asyncrl.engine.blocking import post_json

    served = None
    if actor.rank == 0:
        body = {
            "input_ids": PROMPT,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
        }
        out = post_json(url, "/generate", body, timeout_s=TIMEOUT_S, step="generate")
        served = [(lp, t) for lp, t, _ in out["meta_info"]["output_token_logprobs"]]
    served = bcast(served)
    ids = [t for _, t in served]
    (mine, _), *_ = actor.compute_logprobs([PROMPT + ids], [len(PROMPT)])
    return float((mine.double() - torch.tensor([lp for lp, _ in served], dtype=torch.float64)).abs().max())


def _worker(hf: str, out: str, pp: int, url: str) -> None:
    """``pp``: the actor's PP (the test runs 1 on 2 ranks; by hand, ``_launch`` on 4 ranks: PP=2 x EP=2, or EP=2 with
    expert-DP=2)."""
    import torch
    import torch.distributed as dist
    from sharded_helpers import bcast, broadcast_then_sharded, gather
    from sync_helpers import served_version

    from asyncrl.actor.megatron_actor import Actor
    from asyncrl.actor.names import is_expert
    from asyncrl.actor.shard_source import param_metas
    from asyncrl.actor.synthetic import synthetic_groups, tiny_actor_config
    from asyncrl.actor.weights import local_params
    from asyncrl.config.schema import SyncConfig
    from asyncrl.sync.sharded import sync_weights_sharded

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    actor = Actor(tiny_actor_config(hf, actor={"expert_model_parallel_size": 2, "pipeline_model_parallel_size": pp}))
    vocab = json.loads((Path(hf) / "config.json").read_text())["vocab_size"]
    sync_cfg = SyncConfig(
        bucket_bytes=64 * 1024, backend="gloo", join_timeout_s=TIMEOUT_S, step_timeout_s=TIMEOUT_S, verify_interval=1
    )
    # 1. the broadcast topology: every byte through actor rank 0 (its own metas: what it holds); 2. the sharded
    # topology: each EP rank sends its own experts (and a share of the dense parameters)
    r, sharded, source, _ = broadcast_then_sharded(
        actor,
        [url],
        sync_cfg,
        repeats=REPEATS,
        rank0_metas=lambda: param_metas(actor.model, actor.spec, tp=actor.tp, experts=actor.experts),
    )
    r["ep_rank"] = gather(actor.experts.rank)
    r["senders"] = sharded.senders
    r["owners"] = [b.owner for b in sharded.plan.buckets]
    r["metas_everywhere"] = gather([(m.name, m.ep_rank) for m in source.metas])
    held = dict(local_params(actor.model, actor.layer_offset, actor.experts.offset))  # this rank's, global names
    mine = [m.name for m in source.metas if sharded.plan.owners[m.name] == sharded.sender]
    r["owns_only_what_it_holds"] = gather(all(n in held for n in mine))
    tp, ep = sharded.plan.tp, sharded.plan.ep  # sender i: TP rank i % tp of EP rank (i // tp) % ep, stage i // (tp ep)
    owner = sharded.plan.owners
    r["expert_owner_is_holder"] = all(
        (owner[m.name] // tp) % ep == m.ep_rank and owner[m.name] // (tp * ep) == m.stage
        for m in source.metas
        if is_expert(m.name)
    )
    r["gap_v0"] = _served_gap(actor, url)

    # 3. train, change EP rank 1's experts, sync, compare what the engine serves with the actor's own log-probs
    m = actor.train_step(synthetic_groups(seed=1, num_groups=2, group_size=4, vocab_size=vocab) if rank == 0 else None)
    r["step_skipped"] = m["train/step_skipped"]
    with torch.no_grad():
        for name, p in held.items():
            if actor.experts.rank == 1 and is_expert(name):  # on every replica of EP rank 1
                p.mul_(1.5)
    r["gap_before_sync"] = _served_gap(actor, url)
    res = sync_weights_sharded(sharded, None, bcast=bcast)
    r["gap_after_sync"] = _served_gap(actor, url)
    sharded.destroy()
    if rank == 0:
        r["version_after_train"] = res.version
        r["served_version"] = served_version(url)
        r["actor_version"] = actor.version
        Path(out).write_text(json.dumps(r, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _launch(tmp_path: Path, *, nproc: int = 2, pp: int = 1) -> dict:
    """One CPU engine and the torchrun launch of ``_worker``; its results."""
    from asyncrl.cpu_engine.testing import running_cpu_engine
    from asyncrl.models.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf", arch="qwen3_moe", num_hidden_layers=2)
    out = tmp_path / "out.json"
    with running_cpu_engine(hf, log_dir=tmp_path / "logs") as e1:
        run_torchrun_worker(__file__, [str(hf), str(out), str(pp), e1.url], tmp_path / "worker.log", nproc=nproc)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_sharded_sync_ep2_each_ep_rank_sends_its_own_experts(tmp_path):
    r = _launch(tmp_path)
    print(json.dumps({k: r[k] for k in ("broadcast", "sharded", "planned", "counted", "owners")}, indent=1))
    print(json.dumps({k: r[k] for k in ("gap_v0", "gap_before_sync", "gap_after_sync")}))
    b, s = r["broadcast"], r["sharded"]
    assert r["ep_rank"] == [0, 1] and r["senders"] == [0, 1]  # EP rank e is sender e
    metas = r["metas_everywhere"]
    assert metas[0] == metas[1]  # both ranks plan from the whole model
    experts = {n: e for n, e in metas[0] if e is not None}
    assert len(experts) == 2 * 8 * 2  # 2 layers x 8 experts x (fc1, fc2), each once
    assert all(e == int(n.split(".local_experts.")[1].split(".")[0]) // 4 for n, e in experts.items())
    assert r["expert_owner_is_holder"] and all(r["owns_only_what_it_holds"])
    assert sorted(set(r["owners"])) == [0, 1]  # both EP ranks send
    assert r["counted"] == r["planned"]  # each rank moved what the plan says
    assert s["bytes"] == b["bytes"] and sum(r["planned"]) == b["bytes"]  # the whole model, each byte once
    assert s["rank0_bytes"] == r["planned"][0] < b["rank0_bytes"]  # below the funnel through rank 0
    assert s["max_rank_bytes"] == max(r["planned"]) < 0.6 * b["bytes"]  # the two shares about balanced
    assert s["version"] == "0" and (s["verified"] > 0 or s["unsupported"])  # Qwen3-MoE: not readable by name
    assert r["step_skipped"] == 0.0
    assert r["gap_v0"] < LP_TOL  # the engine serves the actor's weights
    assert r["gap_before_sync"] > 100 * LP_TOL  # the step and EP rank 1's experts moved the log-probs
    assert r["gap_after_sync"] < LP_TOL  # ... and the sharded sync shipped them, EP rank 1's experts included
    assert r["version_after_train"] == "1" == r["served_version"] == str(r["actor_version"])


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
