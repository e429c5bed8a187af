"""Each data-parallel rank gets its own share of the batch: rank 0 splits, sends each rank only its share.

``scatter_samples`` is collective over the actor's world (the default process group): actor rank 0 holds
the batch's samples (``groups_to_samples``), splits them over the DP replicas with ``split_balanced`` and
sends every other rank the share of its replica (TP and PP peers of one replica get the same share) as
three flat tensors: sizes ``[n, tokens, response tokens]`` (int64), the int64 data (lengths, prompt lengths,
tokens, loss mask) and the float64 data (logprobs, aggregation weights, advantages, rewards), point to point
on the actor's device (NCCL sends CUDA tensors, gloo CPU ones). Nothing is pickled; no rank receives
another replica's samples.

    mine = scatter_samples(samples if rank == 0 else None, dp=dp, dp_rank=dp_rank, device=device)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

from asyncrl.actor.batch import Sample, split_balanced


def flatten(share: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples -> (sizes int64[3], ints int64, floats float64); ``unflatten`` inverts it."""
    lens = [s.num_tokens for s in share]
    resp = [s.response_len for s in share]
    ints = torch.cat(
        [
            torch.tensor(lens + [s.prompt_len for s in share], dtype=torch.int64),
            *[s.tokens.to(torch.int64) for s in share],
            *[s.loss_mask.to(torch.int64) for s in share],
        ]
    )
    floats = torch.cat(
        [
            *[s.rollout_logprobs.to(torch.float64) for s in share],
            *[s.agg_weight.to(torch.float64) for s in share],
            torch.tensor([s.advantage for s in share] + [s.reward for s in share], dtype=torch.float64),
        ]
    )
    return torch.tensor([len(share), sum(lens), sum(resp)], dtype=torch.int64), ints, floats


def unflatten(sizes: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor) -> list[Sample]:
    n, n_tok, n_resp = (int(x) for x in sizes.tolist())
    lens = ints[:n].tolist()
    plens = ints[n : 2 * n].tolist()
    tokens = torch.split(ints[2 * n : 2 * n + n_tok], lens)
    rl = [a - b for a, b in zip(lens, plens)]
    mask = torch.split(ints[2 * n + n_tok : 2 * n + n_tok + n_resp].to(torch.bool), rl)
    logp = torch.split(floats[:n_resp].to(torch.float32), rl)
    agg = torch.split(floats[n_resp : 2 * n_resp], rl)
    tail = floats[2 * n_resp :].tolist()
    return [Sample(tokens[i], plens[i], mask[i], logp[i], tail[i], agg[i], tail[n + i]) for i in range(n)]


def scatter_samples(
    samples: Optional[list[Sample]], *, dp: int, dp_rank: int, device: torch.device | str = "cpu"
) -> list[Sample]:
    """This rank's share of ``samples`` (given on rank 0 only; collective over the default group)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        assert samples is not None and dp == 1
        return samples
    mine = torch.tensor([dp_rank], dtype=torch.int64, device=device)
    replica = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(replica, mine)  # the DP replica of every rank
    if dist.get_rank() != 0:
        sizes = torch.zeros(3, dtype=torch.int64, device=device)
        dist.recv(sizes, src=0)
        n, n_tok, n_resp = (int(x) for x in sizes.tolist())
        ints = torch.empty(2 * n + n_tok + n_resp, dtype=torch.int64, device=device)
        floats = torch.empty(2 * n_resp + 2 * n, dtype=torch.float64, device=device)
        dist.recv(ints, src=0)
        dist.recv(floats, src=0)
        return unflatten(sizes.cpu(), ints.cpu(), floats.cpu())
    assert samples is not None
    parts = split_balanced([s.num_tokens for s in samples], dp)
    flat = [flatten([samples[i] for i in p]) for p in parts]
    for r in range(1, world):
        for t in flat[int(replica[r].item())]:
            dist.send(t.to(device), dst=r)
    return [samples[i] for i in parts[int(replica[0].item())]]
