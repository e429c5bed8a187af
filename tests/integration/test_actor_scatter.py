"""``asyncrl.actor.scatter.scatter_samples`` over a real gloo world of 4 ranks (DP 2 x 2 peers per replica):
each rank gets exactly its replica's share of ``split_balanced``, peers of a replica the same one."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.cluster.ports import free_port

WORLD, DP = 4, 2
REPLICA = [0, 1, 0, 1]  # the DP replica of each rank (ranks 0 and 2 are peers, like TP ranks)


def _rank(rank: int, port: int, out) -> None:
    from asyncrl.actor.batch import groups_to_samples, split_balanced
    from asyncrl.actor.scatter import scatter_samples
    from asyncrl.actor.synthetic import synthetic_groups

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        groups = synthetic_groups(seed=5, num_groups=4, group_size=3, vocab_size=300)
        everything = groups_to_samples(groups, normalize_adv_by_std=True, loss_agg_mode="token_mean")
        mine = scatter_samples(everything if rank == 0 else None, dp=DP, dp_rank=REPLICA[rank])
        want = [everything[i] for i in split_balanced([s.num_tokens for s in everything], DP)[REPLICA[rank]]]
        ok = len(mine) == len(want) and all(
            torch.equal(a.tokens, b.tokens)
            and torch.equal(a.loss_mask, b.loss_mask)
            and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
            and torch.equal(a.agg_weight, b.agg_weight)
            and (a.prompt_len, a.advantage, a.reward) == (b.prompt_len, b.advantage, b.reward)
            for a, b in zip(mine, want)
        )
        out.put((rank, ok, len(mine), len(everything)))
    finally:
        dist.destroy_process_group()


def test_each_rank_gets_its_replicas_share():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got = sorted(out.get(timeout=120) for _ in range(WORLD))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [g[1] for g in got] == [True] * WORLD, got
    assert got[0][2] == got[2][2] and got[1][2] == got[3][2]  # peers of a replica: the same share
    assert got[0][2] + got[1][2] == got[0][3]  # the two replicas' shares are the whole batch
    assert all(p.exitcode == 0 for p in procs)
