"""The actor's side of a sharded weight sync: its parameters as the plan sees them, and each planned bucket gathered
over TP to its owner only (``asyncrl.sync.sharded`` drives it; ``asyncrl.sync.shard_plan`` plans it).

Contract
- ``param_metas(model, spec, tp=, layer_offset=0, stage=0)``: every local parameter as a ``shard_plan.ParamMeta``
  (global name, its stage, TP-split or replicated, one shard's bytes, the HF tensors it becomes), computed on the
  meta device: the converter runs on shapes, no data moves. The same list on every TP rank of a stage (their shards
  have the same shapes).
- ``ShardSource(actor)`` (collective over the actor ranks, once: one ``all_gather_object``): every rank learns every
  rank's (stage, TP rank, DP rank) and each stage's metas (from the stage's TP-rank-0 / DP-rank-0 member), so
  ``metas`` is the WHOLE model in model order on every rank, and ``senders`` the global ranks of the senders,
  stage-major (``shard_plan``'s numbering: TP rank t of stage s, DP rank 0, is sender ``s * TP + t``).
- ``gather(bucket, owner)`` (collective over the owner's TP group, every member in the same bucket order): the owner
  (a global rank) gets the bucket's HF tensors, in ``bucket.hf`` order, gathered with ``dist.gather`` (not
  all-gathered: the other ranks receive nothing) and converted; the other members send their shard and get ``[]``.
  A rank outside the owner's TP group (another pipeline stage) takes no part and gets ``[]``. A replicated
  parameter (a norm) is not gathered: the owner's own copy is the full tensor. ``counts`` adds up the bytes this
  rank received / sent in the gathers.
- TP, PP and DP actors; not expert parallelism: an EP rank holds only its share of the experts (ValueError).

    src = ShardSource(actor)                                      # every actor rank
    plan = plan_shards(src.metas, num_senders=len(src.senders), bucket_bytes=512 << 20, pp=src.pp)
    tensors = src.gather(plan.buckets[0], owner=src.senders[0])   # its TP group; [(hf_name, tensor)] on the owner
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from asyncrl.actor.convert import megatron_to_hf, tp_merge
from asyncrl.actor.names import tp_split_dim
from asyncrl.actor.weights import is_tied_output_copy, local_params
from asyncrl.sync.bucketing import dtype_name, tensor_nbytes
from asyncrl.sync.shard_plan import HfMeta, ParamMeta, PlannedBucket


@torch.no_grad()
def param_metas(model: torch.nn.Module, spec, *, tp: int, layer_offset: int = 0, stage: int = 0) -> list[ParamMeta]:
    """The plan's input for this stage from the model's shapes alone (see module contract)."""
    out = []
    for name, p in local_params(model, layer_offset):
        sharded = tp > 1 and tp_split_dim(name) is not None
        local = torch.empty(p.shape, dtype=p.dtype, device="meta")
        full = tp_merge(name, [local] * tp) if sharded else local
        hf = () if is_tied_output_copy(name, spec) else tuple(megatron_to_hf(name, full, spec))
        out.append(
            ParamMeta(
                name=name,
                sharded=sharded,
                shard_nbytes=tensor_nbytes(local),
                hf=tuple(HfMeta(n, tuple(t.shape), dtype_name(t.dtype), tensor_nbytes(t)) for n, t in hf),
                stage=stage,
            )
        )
    return out


@dataclass
class GatherCounts:
    """Bytes this rank moved in the TP gathers of one sync."""

    received: int = 0
    sent: int = 0


class ShardSource:
    """One actor rank's weights for a sharded sync (see module contract)."""

    def __init__(self, actor):
        if actor.experts.ep > 1:
            raise ValueError(
                "sync.topology = 'sharded' does not support expert parallelism (actor.expert_model_parallel_size = "
                f"{actor.experts.ep}): an EP rank holds only its share of the experts; use sync.topology = 'broadcast'"
            )
        self.actor = actor
        self.model, self.spec, self.tp, self.tp_group = actor.model, actor.spec, actor.tp, actor.tp_group
        self.pp, self.layer_offset = actor.pp, actor.layer_offset
        self.tp_ranks: list[int] = dist.get_process_group_ranks(self.tp_group) if self.tp > 1 else [dist.get_rank()]
        """global ranks of this rank's TP group, in TP-rank order"""
        own = param_metas(self.model, self.spec, tp=self.tp, layer_offset=self.layer_offset, stage=actor.pp_rank)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, ((actor.pp_rank, actor.tp_rank, actor.dp_rank), own))
        coords = [c for c, _ in everyone]
        self.senders: list[int] = [coords.index((s, t, 0)) for s in range(self.pp) for t in range(self.tp)]
        """global ranks of the senders, stage-major (see module contract); ``senders[0]`` is actor rank 0"""
        assert self.senders[0] == 0, f"actor rank 0 is not stage 0's TP rank 0 of DP replica 0: {coords[0]}"
        self.metas: list[ParamMeta] = [m for s in range(self.pp) for m in everyone[self.senders[s * self.tp]][1]]
        """the whole model's parameters, in model order (every stage's)"""
        self.counts = GatherCounts()
        self._params: dict[str, torch.nn.Parameter] = {}

    @property
    def version(self) -> int:
        return self.actor.version

    def begin(self) -> None:
        """Before a sync's first gather: zero the counts, look the parameters up once."""
        self.counts = GatherCounts()
        self._params = dict(local_params(self.model, self.layer_offset))

    @torch.no_grad()
    def gather(self, bucket: PlannedBucket, *, owner: int) -> list[tuple[str, torch.Tensor]]:
        """The bucket's HF tensors on ``owner`` (a global rank), ``[]`` elsewhere (collective over the owner's TP
        group; a rank outside it takes no part)."""
        if owner not in self.tp_ranks:
            return []
        mine = dist.get_rank() == owner
        out: list[tuple[str, torch.Tensor]] = []
        for name in bucket.params:
            local = self._params[name].detach()
            sharded = self.tp > 1 and tp_split_dim(name) is not None
            if sharded and mine:
                shards = [torch.empty_like(local) for _ in range(self.tp)]
                dist.gather(local.contiguous(), gather_list=shards, dst=owner, group=self.tp_group)
                self.counts.received += (self.tp - 1) * tensor_nbytes(local)
                out.extend(megatron_to_hf(name, tp_merge(name, shards), self.spec))
            elif sharded:
                dist.gather(local.contiguous(), dst=owner, group=self.tp_group)
                self.counts.sent += tensor_nbytes(local)
            elif mine:
                out.extend(megatron_to_hf(name, local.clone(), self.spec))  # never the parameter's own storage
        return out
