"""Each data-parallel rank gets its own share of the batch: rank 0 splits, sends each rank only its share.

``scatter_samples`` is collective over the actor's world (the default process group): actor rank 0 holds
the batch's samples (``groups_to_samples``), splits them over the DP replicas with ``split_balanced`` and
sends every other rank the share of its replica (TP and PP peers of one replica get the same share) as
three flat tensors, point to point on the actor's device (NCCL sends CUDA tensors, gloo CPU ones): sizes
``[n, tokens, response tokens, POSITION width]`` (int64), the int64 data and the float64 data. The int64 data
opens with the lengths, the prompt lengths and the tokens; then every field of ``asyncrl.actor.batch.SAMPLE_FIELDS`` (the
record's trained fields, ``asyncrl.broker.record``, and the actor's derived ones) follows in its order, in the
int64 data (integers, bools) or the float64 data (floats): a per-token field as its samples' values back to
back (a ``POSITION`` field: its rows of the share's width, the sizes' last entry, -1 rows for a sample without
it; nothing when no sample of the share has it: width 0, None on arrival), a scalar as one value per sample. The
layout is derived from that list alone, so a field declared there travels with no change here. Nothing is
pickled; no rank receives another replica's samples.

    mine = scatter_samples(samples if rank == 0 else None, dp=dp, dp_rank=dp_rank, device=device)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from asyncrl.actor.batch import SAMPLE_FIELDS, Sample, split_balanced
from asyncrl.broker.record import POSITION, PROMPT, RESPONSE, SCALAR

# Each field's part of the flat tensors: (name, per, carried as an integer, its tensor dtype in a Sample).
_LAYOUT = tuple(
    (f.name, f.per, f.dtype.kind in "biu", torch.from_numpy(np.empty(0, f.dtype)).dtype) for f in SAMPLE_FIELDS
)


def _lengths(n: int, n_tok: int, n_resp: int, width: int) -> tuple[int, int]:
    """The lengths of the int64 and the float64 data of ``n`` samples of ``n_tok`` tokens, ``n_resp`` of them
    in responses, ``width`` values a position in a ``POSITION`` field."""
    per = {PROMPT: n_tok - n_resp, RESPONSE: n_resp, POSITION: n_tok * width, SCALAR: n}
    ints = 2 * n + n_tok + sum(per[p] for _, p, is_int, _ in _LAYOUT if is_int)
    return ints, sum(per[p] for _, p, is_int, _ in _LAYOUT if not is_int)


def flatten(share: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples -> (sizes int64[4], ints int64, floats float64); ``unflatten`` inverts it."""
    lens = [s.num_tokens for s in share]
    resp = [s.response_len for s in share]
    ints = [torch.tensor(lens + [s.prompt_len for s in share], dtype=torch.int64)]
    ints += [s.tokens.to(torch.int64) for s in share]
    floats = [torch.empty(0, dtype=torch.float64)]  # torch.cat needs one tensor
    width = 0
    for name, per, is_int, _ in _LAYOUT:
        out, carrier = (ints, torch.int64) if is_int else (floats, torch.float64)
        if per == SCALAR:
            out.append(torch.tensor([getattr(s, name) for s in share], dtype=carrier))
        elif per == POSITION:
            rows = [getattr(s, name) for s in share]
            width = next((r.shape[1] for r in rows if r is not None), 0)
            if width:
                out += [
                    torch.full((s.num_tokens, width), -1) if r is None else r.to(carrier) for s, r in zip(share, rows)
                ]
        else:
            out += [getattr(s, name).to(carrier) for s in share]
    sizes = torch.tensor([len(share), sum(lens), sum(resp), width], dtype=torch.int64)
    return sizes, torch.cat([t.reshape(-1) for t in ints]), torch.cat(floats)


def unflatten(sizes: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor) -> list[Sample]:
    n, n_tok, n_resp, width = (int(x) for x in sizes.tolist())
    lens = ints[:n].tolist()
    plens = ints[n : 2 * n].tolist()
    tokens = torch.split(ints[2 * n : 2 * n + n_tok], lens)
    split = {PROMPT: plens, RESPONSE: [a - b for a, b in zip(lens, plens)], POSITION: [n * width for n in lens]}
    at = {True: 2 * n + n_tok, False: 0}  # the next field's start in the int64 and the float64 data
    fields = {}
    for name, per, is_int, dtype in _LAYOUT:
        data = ints if is_int else floats
        size = n if per == SCALAR else sum(split[per])
        part = data[at[is_int] : at[is_int] + size].to(dtype)
        at[is_int] += size
        if per == SCALAR:
            fields[name] = part.tolist()
        elif per == POSITION:
            fields[name] = [r.view(-1, width) for r in torch.split(part, split[per])] if width else [None] * n
        else:
            fields[name] = torch.split(part, split[per])
    return [Sample(tokens=tokens[i], prompt_len=plens[i], **{k: v[i] for k, v in fields.items()}) for i in range(n)]


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
        sizes = torch.zeros(4, dtype=torch.int64, device=device)
        dist.recv(sizes, src=0)
        n_ints, n_floats = _lengths(*(int(x) for x in sizes.tolist()))
        ints = torch.empty(n_ints, dtype=torch.int64, device=device)
        floats = torch.empty(n_floats, dtype=torch.float64, device=device)
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
