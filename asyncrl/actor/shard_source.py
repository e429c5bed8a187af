"""The actor's side of a sharded weight sync: its parameters as the plan sees them, and each planned bucket gathered
over TP to its owner only (``asyncrl.sync.sharded`` drives it; ``asyncrl.sync.shard_plan`` plans it).

Contract
- ``param_metas(model, spec, tp=)``: every local parameter as a ``shard_plan.ParamMeta`` (TP-split or replicated, one
  shard's bytes, the HF tensors it becomes), computed on the meta device: the converter runs on shapes, no data moves.
  The same list on every TP rank (their shards have the same shapes).
- ``ShardSource(actor)``: ``gather(bucket, owner)`` (collective over the actor's TP group, every member in the same
  bucket order): the owner (a global rank) gets the bucket's HF tensors, in ``bucket.hf`` order, gathered with
  ``dist.gather`` (not all-gathered: the other ranks receive nothing) and converted; the other members send their
  shard and get ``[]``. A replicated parameter (a norm) is not gathered: the owner's own copy is the full tensor.
  ``counts`` adds up the bytes this rank received / sent in the gathers.
- TP and DP actors only: a pipeline stage or an expert-parallel rank holds only part of the model (ValueError).

    src = ShardSource(actor)
    plan = plan_shards(src.metas, num_senders=2, bucket_bytes=512 << 20)
    tensors = src.gather(plan.buckets[0], owner=0)   # every TP rank; [(hf_name, full tensor)] on rank 0
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
def param_metas(model: torch.nn.Module, spec, *, tp: int) -> list[ParamMeta]:
    """The plan's input from the model's shapes alone (see module contract)."""
    out = []
    for name, p in local_params(model):
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
        if getattr(actor, "stage", None) is not None or actor.experts.ep > 1:
            raise ValueError("sync.topology = 'sharded' supports TP (and DP) actors only, not PP or EP")
        self.actor = actor
        self.model, self.spec, self.tp, self.tp_group = actor.model, actor.spec, actor.tp, actor.tp_group
        self.tp_ranks: list[int] = dist.get_process_group_ranks(self.tp_group) if self.tp > 1 else [dist.get_rank()]
        """global ranks of this rank's TP group, in TP-rank order"""
        self.metas = param_metas(self.model, self.spec, tp=self.tp)
        self.counts = GatherCounts()
        self._params: dict[str, torch.nn.Parameter] = {}

    @property
    def version(self) -> int:
        return self.actor.version

    def begin(self) -> None:
        """Before a sync's first gather: zero the counts, look the parameters up once."""
        self.counts = GatherCounts()
        self._params = dict(local_params(self.model))

    @torch.no_grad()
    def gather(self, bucket: PlannedBucket, *, owner: int) -> list[tuple[str, torch.Tensor]]:
        """The bucket's HF tensors on ``owner`` (a global rank of this TP group), ``[]`` elsewhere (collective)."""
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
