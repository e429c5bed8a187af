"""The actor's side of a sharded weight sync: its parameters as the plan sees them, and each planned bucket gathered
over TP to its owner only (``asyncrl.sync.sharded`` drives it; ``asyncrl.sync.shard_plan`` plans it).

Contract
- ``param_metas(model, spec, tp=, layer_offset=0, stage=0, experts=None)``: every local parameter as a
  ``shard_plan.ParamMeta`` (global name, its stage, the EP rank holding it for an expert's at EP > 1, TP-split or
  replicated, one shard's bytes, the HF tensors it becomes), computed on the meta device: the converter runs on
  shapes, no data moves. The same list on every TP rank of a stage and EP rank (their shards have the same shapes).
- ``ShardSource(actor)`` (collective over the actor ranks, once: one ``all_gather_object``): every rank learns every
  rank's coordinates (stage, TP rank, DP rank; EP, expert-TP and expert-DP rank) and the metas of each stage and EP
  rank (from its TP-rank-0 member of expert-DP replica 0), so ``metas`` is the WHOLE model in model order on every
  rank (a MoE layer's experts in global order, EP rank 0's, then 1's, ...), and ``senders`` the global ranks of the
  senders, stage-major then EP-major (``shard_plan``'s numbering: TP rank t of EP rank e of stage s, expert-DP rank
  0, is sender ``(s * EP + e) * TP + t``). Without EP they are the TP ranks of every stage of DP replica 0. With EP
  they are megatron-core's expert grid (``tp-ep-dp-pp``, expert TP = TP): EP rank e of actor rank 0's expert-DP
  replica is a dense data-parallel replica (DP rank e), whose TP group is its expert-TP group (checked).
- ``gather(bucket, owner)`` (collective over the owner's TP group, every member in the same bucket order): the owner
  (a global rank) gets the bucket's HF tensors, in ``bucket.hf`` order, gathered with ``dist.gather`` (not
  all-gathered: the other ranks receive nothing; an expert over the expert-TP group) and converted; the other
  members send their shard and get ``[]``. A rank outside the owner's TP group (another pipeline stage, another
  EP rank or replica) takes no part and gets ``[]``. A replicated parameter (a norm) is not gathered: the owner's
  own copy is the full tensor. ``counts`` adds up the bytes this rank received / sent in the gathers.
- TP, PP, DP and EP actors (every EP rank of actor rank 0's expert-DP replica sends its own experts; the dense
  parameters go to any sender of their stage, each EP rank holding a copy).

    src = ShardSource(actor)                                      # every actor rank
    plan = plan_shards(src.metas, num_senders=len(src.senders), bucket_bytes=512 << 20, pp=src.pp, ep=src.ep)
    tensors = src.gather(plan.buckets[0], owner=src.senders[0])   # its TP group; [(hf_name, tensor)] on the owner
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from asyncrl.actor.convert import megatron_to_hf, tp_merge
from asyncrl.actor.names import EXPERT_NAME, is_expert, tp_split_dim
from asyncrl.actor.weights import ExpertShards, is_tied_output_copy, local_params
from asyncrl.sync.bucketing import dtype_name, tensor_nbytes
from asyncrl.sync.shard_plan import HfMeta, ParamMeta, PlannedBucket


@torch.no_grad()
def param_metas(
    model: torch.nn.Module,
    spec,
    *,
    tp: int,
    layer_offset: int = 0,
    stage: int = 0,
    experts: ExpertShards | None = None,
) -> list[ParamMeta]:
    """The plan's input for this stage (and EP rank) from the model's shapes alone (see module contract)."""
    ex = experts or ExpertShards()
    out = []
    for name, p in local_params(model, layer_offset, ex.offset):
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
                ep_rank=ex.rank if ex.ep > 1 and is_expert(name) else None,
            )
        )
    return out


def _merge_experts(per_ep: list[list[ParamMeta]]) -> list[ParamMeta]:
    """One stage's metas from each EP rank's: EP rank 0's in model order, each MoE layer's experts followed by the
    other EP ranks' experts of that layer (global expert order)."""
    others: dict[str, list[ParamMeta]] = {}
    for metas in per_ep[1:]:
        for m in metas:
            if is_expert(m.name):
                others.setdefault(EXPERT_NAME.match(m.name).group(1), []).append(m)
    out: list[ParamMeta] = []
    first = per_ep[0]
    for i, m in enumerate(first):
        out.append(m)
        if not is_expert(m.name):
            continue
        layer = EXPERT_NAME.match(m.name).group(1)
        nxt = first[i + 1].name if i + 1 < len(first) else ""
        if not is_expert(nxt) or EXPERT_NAME.match(nxt).group(1) != layer:  # EP rank 0's last expert of the layer
            out.extend(others.pop(layer, []))
    assert not others, f"experts of layers EP rank 0 does not hold: {sorted(others)}"
    return out


@dataclass
class GatherCounts:
    """Bytes this rank moved in the TP gathers of one sync."""

    received: int = 0
    sent: int = 0


class ShardSource:
    """One actor rank's weights for a sharded sync (see module contract)."""

    def __init__(self, actor):
        self.actor = actor
        self.model, self.spec, self.tp, self.tp_group = actor.model, actor.spec, actor.tp, actor.tp_group
        self.pp, self.layer_offset, self.experts = actor.pp, actor.layer_offset, actor.experts
        self.ep = self.experts.ep
        self.tp_ranks: list[int] = dist.get_process_group_ranks(self.tp_group) if self.tp > 1 else [dist.get_rank()]
        """global ranks of this rank's TP group, in TP-rank order"""
        own = param_metas(
            self.model, self.spec, tp=self.tp, layer_offset=self.layer_offset, stage=actor.pp_rank, experts=self.experts
        )
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (self._coords(), own))
        coords = [c for c, _ in everyone]
        grid = [(s, e, t) for s in range(self.pp) for e in range(self.ep) for t in range(self.tp)]
        self.senders: list[int] = [[c[2:] for c in coords].index((s, e, t, 0)) for s, e, t in grid]
        """global ranks of the senders, stage-major then EP-major (see module contract); ``senders[0]`` is actor
        rank 0"""
        assert self.senders[0] == 0, f"actor rank 0 is not sender 0 (stage 0, TP rank 0, EP rank 0): {coords[0]}"
        for k in range(0, len(self.senders), self.tp):  # each EP rank's TP ranks: one dense TP group of its stage
            dense = {coords[r][0] for r in self.senders[k : k + self.tp]}
            assert len(dense) == 1, f"senders {self.senders[k : k + self.tp]} are not one TP group: {coords}"
        if self.ep > 1 and self.tp > 1:
            etp = dist.get_process_group_ranks(self.experts.tp_group or self.tp_group)
            assert etp == self.tp_ranks, f"expert-TP group {etp} is not the TP group {self.tp_ranks}"
        first = [self.senders[k] for k in range(0, len(self.senders), self.tp)]  # (s, e): its TP rank 0
        self.metas: list[ParamMeta] = [
            m
            for s in range(self.pp)
            for m in _merge_experts([everyone[r][1] for r in first[s * self.ep : (s + 1) * self.ep]])
        ]
        """the whole model's parameters, in model order (every stage's, every expert)"""
        self.counts = GatherCounts()
        self._params: dict[str, torch.nn.Parameter] = {}

    def _coords(self) -> tuple[int, int, int, int, int, int]:
        """(DP rank, TP rank, stage, EP rank, expert-TP rank, expert-DP rank) of this rank; without EP the expert
        grid is the dense one (EP rank 0, expert TP = TP, expert DP = DP)."""
        a = self.actor
        if self.ep == 1:
            return (a.dp_rank, a.tp_rank, a.pp_rank, 0, a.tp_rank, a.dp_rank)
        from megatron.core import parallel_state as ps

        etp, edp = ps.get_expert_tensor_parallel_rank(), ps.get_expert_data_parallel_rank()
        return (a.dp_rank, a.tp_rank, a.pp_rank, self.experts.rank, etp, edp)

    @property
    def version(self) -> int:
        return self.actor.version

    def begin(self) -> None:
        """Before a sync's first gather: zero the counts, look the parameters up once."""
        self.counts = GatherCounts()
        self._params = dict(local_params(self.model, self.layer_offset, self.experts.offset))

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
            group = (self.experts.tp_group or self.tp_group) if is_expert(name) else self.tp_group
            if sharded and mine:
                shards = [torch.empty_like(local) for _ in range(self.tp)]
                dist.gather(local.contiguous(), gather_list=shards, dst=owner, group=group)
                self.counts.received += (self.tp - 1) * tensor_nbytes(local)
                out.extend(megatron_to_hf(name, tp_merge(name, shards), self.spec))
            elif sharded:
                dist.gather(local.contiguous(), dst=owner, group=group)
                self.counts.sent += tensor_nbytes(local)
            elif mine:
                out.extend(megatron_to_hf(name, local.clone(), self.spec))  # never the parameter's own storage
        return out
