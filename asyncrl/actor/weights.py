"""Weights in and out of the actor's (TP-sharded) GPTModel.

- ``load_hf_into_model(model, path, spec, tp_rank=, tp=)``: every rank reads only the tensors it
  needs (one full tensor at a time, memory-mapped, ``asyncrl.models.safetensors_io``) and keeps its own
  TP shard (and, for a MoE model, only its EP rank's experts).
- ``iter_full_megatron(model, tp_group)``: full (unsharded) Megatron tensors, gathered over the
  TP group with ``all_gather``. Collective: every rank of the TP group (and of the EP group) must iterate
  it to the end, in the same order.
- Expert parallelism (``ExpertShards``: EP size and rank, the EP and expert-TP groups, experts per rank):
  EP rank r holds experts ``[r * n, (r + 1) * n)`` of every MoE layer (megatron-core's layout) under local
  indices; ``local_params`` names them globally. ``iter_full_megatron`` yields each MoE layer's experts
  in global order (0 .. num_experts - 1, ``linear_fc1`` then ``linear_fc2``) wherever the model keeps
  them (SequentialMLP and TE's grouped linears order their parameters differently): each expert is
  broadcast from its EP rank over the EP group, then gathered over the expert-TP group, so every rank of
  the EP group gets every expert, in the same order.
- ``iter_hf_tensors`` / ``iter_hf_buckets``: the same as HF-named tensors, vocab padding stripped,
  grouped in buckets of at most ``bucket_bytes``.

Pipeline parallelism: a stage's parameters are named ``decoder.layers.<local index>`` by Megatron;
``layer_offset`` (the stage's first global layer) turns them into the global names used
everywhere else (HF layer index = offset + local index). With tied embeddings the last stage's
``output_layer.weight`` is Megatron's copy of the word embeddings: it loads from
``model.embed_tokens.weight`` and is never exported (the first stage's embedding is).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.actor.convert import (
    hf_names_for,
    hf_to_megatron,
    megatron_param_names,
    megatron_to_hf,
    tp_merge,
    tp_shard,
)
from asyncrl.actor.names import EXPERT_NAME, LAYER_NAME, canonical_megatron_name, global_expert_name
from asyncrl.models.safetensors_io import SafetensorsReader
from asyncrl.models.spec import ModelSpec
from asyncrl.sync.bucketing import iter_buckets


@dataclass(frozen=True)
class ExpertShards:
    """Where this rank's experts sit. The default: no expert parallelism (every expert is local)."""

    ep: int = 1
    rank: int = 0
    """This rank's index in its EP group."""
    num_local: int = 0
    """Experts per EP rank in a MoE layer (0 for a dense model)."""
    group: Any = None
    """The EP group (its ranks hold the same dense shard and the experts' shares)."""
    tp_group: Any = None
    """The expert-TP group (None: the TP group; megatron-core's expert TP is the TP size)."""

    @property
    def offset(self) -> int:
        """Global index of this rank's first expert."""
        return self.rank * self.num_local

    @classmethod
    def current(cls, spec: ModelSpec) -> ExpertShards:
        """This rank's, from megatron-core's parallel state (needs ``initialize_model_parallel``)."""
        if not spec.is_moe:
            return cls()
        from megatron.core import parallel_state as ps

        ep = ps.get_expert_model_parallel_world_size()
        return cls(
            ep=ep,
            rank=ps.get_expert_model_parallel_rank(),
            num_local=spec.num_experts // ep,
            group=ps.get_expert_model_parallel_group(),
            tp_group=ps.get_expert_tensor_parallel_group(),
        )


def global_layer_name(name: str, layer_offset: int) -> str:
    """``decoder.layers.<local>.x`` -> ``decoder.layers.<layer_offset + local>.x`` (other names unchanged)."""
    if layer_offset == 0:
        return name
    m = LAYER_NAME.match(name)
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{m.group(2)}" if m else name


def local_params(
    model: torch.nn.Module, layer_offset: int = 0, expert_offset: int = 0
) -> list[tuple[str, torch.nn.Parameter]]:
    """(canonical global Megatron name, parameter) of this rank's shard, in model order (global layer and
    expert indices: ``layer_offset`` / ``expert_offset`` are this rank's first layer / expert)."""
    return [
        (global_expert_name(global_layer_name(canonical_megatron_name(n), layer_offset), expert_offset), p)
        for n, p in model.named_parameters()
    ]


def is_tied_output_copy(name: str, spec: ModelSpec) -> bool:
    """The last pipeline stage's copy of tied word embeddings (Megatron keeps it in sync)."""
    return spec.tie_word_embeddings and name == "output_layer.weight"


def _hf_parts(name: str, spec: ModelSpec) -> list[str]:
    return ["model.embed_tokens.weight"] if is_tied_output_copy(name, spec) else hf_names_for(name, spec)


@torch.no_grad()
def load_hf_into_model(
    model: torch.nn.Module,
    path: str | Path,
    spec: ModelSpec,
    *,
    tp_rank: int,
    tp: int,
    layer_offset: int = 0,
    pp: int = 1,
    experts: ExpertShards | None = None,
) -> None:
    ex = experts or ExpertShards()
    reader = SafetensorsReader(path)
    seen = set()
    for name, param in local_params(model, layer_offset, ex.offset):
        parts = _hf_parts(name, spec)
        full = hf_to_megatron(name, [reader.get(p) for p in parts], spec, tp=tp)
        shard = tp_shard(name, full, rank=tp_rank, tp=tp)
        if shard.shape != param.shape:
            raise ValueError(f"{name}: checkpoint shard {tuple(shard.shape)} != model {tuple(param.shape)}")
        param.copy_(shard.to(param.dtype))
        seen.update(parts)
    if pp > 1 or ex.ep > 1:  # this rank reads only its own stage's / experts' tensors: check the whole model's
        seen = {p for n in megatron_param_names(spec) for p in hf_names_for(n, spec)}
    unknown = set(reader.keys()) - seen
    if spec.tie_word_embeddings:
        unknown.discard("lm_head.weight")
    if unknown:
        raise KeyError(
            f"HF checkpoint {str(path)!r} has tensors the {spec.model_type} converter does not use: {sorted(unknown)[:5]}"
        )


def _tp_full(name: str, local: torch.Tensor, *, group: dist.ProcessGroup | None, tp: int) -> torch.Tensor:
    if tp == 1:
        return local.clone()  # never the parameter's own storage
    shards = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(shards, local.contiguous(), group=group)
    return tp_merge(name, shards)


def _expert_layer(name: str) -> int | None:
    m = EXPERT_NAME.match(name)
    return int(m.group(1)) if m else None


def _all_experts(
    layer: int, local: dict[str, torch.nn.Parameter], ex: ExpertShards, *, tp_group, tp: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every expert of one MoE layer, full, in global order (see the module docstring). Collective over the EP
    and expert-TP groups."""
    n_local = len(local) // 2
    ranks = dist.get_process_group_ranks(ex.group) if ex.ep > 1 else []
    for e in range(n_local * ex.ep):
        owner = e // n_local
        for k in (1, 2):
            name = f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc{k}.weight"
            if owner == ex.rank:
                t = local[name].detach()
            else:  # same shape as this rank's own experts
                t = torch.empty_like(
                    local[f"decoder.layers.{layer}.mlp.experts.local_experts.{ex.offset}.linear_fc{k}.weight"]
                )
            if ex.ep > 1:
                dist.broadcast(t, src=ranks[owner], group=ex.group)
            yield name, _tp_full(name, t, group=ex.tp_group or tp_group, tp=tp)


@torch.no_grad()
def iter_full_megatron(
    model: torch.nn.Module,
    *,
    tp_group: dist.ProcessGroup | None,
    tp: int,
    layer_offset: int = 0,
    experts: ExpertShards | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full Megatron tensors (TP all-gather; every expert, see the module docstring). Collective over the TP
    group (and the EP group)."""
    ex = experts or ExpertShards()
    params = local_params(model, layer_offset, ex.offset)
    for layer, run in itertools.groupby(params, key=lambda item: _expert_layer(item[0])):
        if layer is not None:
            yield from _all_experts(layer, dict(run), ex, tp_group=tp_group, tp=tp)
            continue
        for name, param in run:
            yield name, _tp_full(name, param.detach(), group=tp_group, tp=tp)


def iter_hf_tensors(
    model: torch.nn.Module,
    spec: ModelSpec,
    *,
    tp_group: dist.ProcessGroup | None,
    tp: int,
    dtype: torch.dtype | None = None,
    layer_offset: int = 0,
    experts: ExpertShards | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    full_tensors = iter_full_megatron(model, tp_group=tp_group, tp=tp, layer_offset=layer_offset, experts=experts)
    for name, full in full_tensors:
        if is_tied_output_copy(name, spec):
            continue
        for hf_name, t in megatron_to_hf(name, full, spec):
            yield hf_name, (t if dtype is None else t.to(dtype))


def iter_hf_buckets(
    model: torch.nn.Module,
    spec: ModelSpec,
    bucket_bytes: int,
    *,
    tp_group: dist.ProcessGroup | None,
    tp: int,
    dtype: torch.dtype | None = None,
    experts: ExpertShards | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    tensors = iter_hf_tensors(model, spec, tp_group=tp_group, tp=tp, dtype=dtype, experts=experts)
    yield from iter_buckets(tensors, bucket_bytes)
