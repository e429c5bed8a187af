"""Weights in and out of the actor's (TP-sharded) GPTModel.

- ``load_hf_into_model(model, path, spec, tp_rank=, tp=)``: every rank reads only the tensors it
  needs (one full tensor at a time, memory-mapped, ``asyncrl.models.safetensors_io``) and keeps its own
  TP shard.
- ``iter_full_megatron(model, tp_group)``: full (unsharded) Megatron tensors, gathered over the
  TP group with ``all_gather``. Collective: every rank of the TP group must iterate it to the end,
  in the same order.
- ``iter_hf_tensors`` / ``iter_hf_buckets``: the same as HF-named tensors, vocab padding stripped,
  grouped in buckets of at most ``bucket_bytes``.

Pipeline parallelism: a stage's parameters are named ``decoder.layers.<local index>`` by Megatron;
``layer_offset`` (the stage's first global layer) turns them into the global names used
everywhere else (HF layer index = offset + local index). With tied embeddings the last stage's
``output_layer.weight`` is Megatron's copy of the word embeddings: it loads from
``model.embed_tokens.weight`` and is never exported (the first stage's embedding is).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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
from asyncrl.actor.names import LAYER_NAME, canonical_megatron_name
from asyncrl.models.safetensors_io import SafetensorsReader
from asyncrl.models.spec import ModelSpec
from asyncrl.sync.bucketing import iter_buckets


def global_layer_name(name: str, layer_offset: int) -> str:
    """``decoder.layers.<local>.x`` -> ``decoder.layers.<layer_offset + local>.x`` (other names unchanged)."""
    if layer_offset == 0:
        return name
    m = LAYER_NAME.match(name)
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{m.group(2)}" if m else name


def local_params(model: torch.nn.Module, layer_offset: int = 0) -> list[tuple[str, torch.nn.Parameter]]:
    """(canonical global Megatron name, parameter) of this rank's shard, in model order."""
    return [(global_layer_name(canonical_megatron_name(n), layer_offset), p) for n, p in model.named_parameters()]


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
) -> None:
    reader = SafetensorsReader(path)
    seen = set()
    for name, param in local_params(model, layer_offset):
        parts = _hf_parts(name, spec)
        full = hf_to_megatron(name, [reader.get(p) for p in parts], spec, tp=tp)
        shard = tp_shard(name, full, rank=tp_rank, tp=tp)
        if shard.shape != param.shape:
            raise ValueError(f"{name}: checkpoint shard {tuple(shard.shape)} != model {tuple(param.shape)}")
        param.copy_(shard.to(param.dtype))
        seen.update(parts)
    if pp > 1:  # this stage reads only its own tensors: check against the whole model's
        seen = {p for n in megatron_param_names(spec) for p in hf_names_for(n, spec)}
    unknown = set(reader.keys()) - seen
    if spec.tie_word_embeddings:
        unknown.discard("lm_head.weight")
    if unknown:
        raise KeyError(
            f"HF checkpoint {str(path)!r} has tensors the {spec.model_type} converter does not use: {sorted(unknown)[:5]}"
        )


@torch.no_grad()
def iter_full_megatron(
    model: torch.nn.Module, *, tp_group: dist.ProcessGroup | None, tp: int, layer_offset: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full Megatron tensors (TP all-gather). Collective over the TP group."""
    for name, param in local_params(model, layer_offset):
        local = param.detach().contiguous()
        if tp == 1:
            yield name, local.clone()
            continue
        shards = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(shards, local, group=tp_group)
        yield name, tp_merge(name, shards)


def iter_hf_tensors(
    model: torch.nn.Module,
    spec: ModelSpec,
    *,
    tp_group: dist.ProcessGroup | None,
    tp: int,
    dtype: torch.dtype | None = None,
    layer_offset: int = 0,
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, full in iter_full_megatron(model, tp_group=tp_group, tp=tp, layer_offset=layer_offset):
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
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    yield from iter_buckets(iter_hf_tensors(model, spec, tp_group=tp_group, tp=tp, dtype=dtype), bucket_bytes)
