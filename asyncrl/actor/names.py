"""Megatron parameter names: the canonical (local-spec) name and the tensor-parallel split dimension. Pure.

megatron-core 0.16.1 names its parameters after the layer spec; the transformer-engine spec fuses the
norms into the linear layers (``...linear_qkv.layer_norm_weight``). ``canonical_megatron_name`` maps both
to the local spec's names (and strips DDP/Float16 ``module.`` prefixes); ``tp_split_dim`` says along which
dimension a full tensor is split over TP ranks. Used by the model builder (to mark TP parameters) and the
converter (``asyncrl.actor.convert``).

    canonical_megatron_name("module.decoder.layers.0.mlp.linear_fc1.layer_norm_weight")
    # -> "decoder.layers.0.pre_mlp_layernorm.weight"
    tp_split_dim("decoder.layers.3.self_attention.linear_proj.weight")   # -> 1 (row-parallel)
"""

from __future__ import annotations

import re

LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
"""A decoder layer's parameter: group 1 the layer index, group 2 the layer-relative name."""

# transformer-engine spec name -> local spec name (layer-relative)
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attention.q_layernorm.weight",
}

# parallel split dimension of each full Megatron tensor (layer-relative names); None = replicated
_COLUMN = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight")
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


def canonical_megatron_name(name: str) -> str:
    """Strip DDP/Float16 wrappers' ``module.`` prefixes and map TE-spec names to local-spec ones."""
    while name.startswith("module."):
        name = name[len("module.") :]
    m = LAYER_NAME.match(name)
    if m and m.group(2) in _TE_ALIASES:
        return f"decoder.layers.{m.group(1)}.{_TE_ALIASES[m.group(2)]}"
    return name


def layer_rest(name: str) -> str:
    """The layer-relative part of a decoder layer's parameter name (the name itself otherwise)."""
    m = LAYER_NAME.match(name)
    return m.group(2) if m else name


def tp_split_dim(mg_name: str) -> int | None:
    """0 for column-parallel (and vocab-parallel) tensors, 1 for row-parallel, None if replicated."""
    name = canonical_megatron_name(mg_name)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    rest = layer_rest(name)
    if rest in _COLUMN:
        return 0
    if rest in _ROW:
        return 1
    return None
