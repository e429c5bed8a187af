"""Megatron parameter names: the canonical (local-spec) name and the tensor-parallel split dimension. Pure.

megatron-core 0.16.1 names its parameters after the layer spec; the transformer-engine spec fuses the
norms into the linear layers (``...linear_qkv.layer_norm_weight``) and keeps a MoE layer's experts in
grouped linears (``mlp.experts.linear_fc1.weight<e>``). ``canonical_megatron_name`` maps both to the local
spec's names (``mlp.experts.local_experts.<e>.linear_fc1.weight``, SequentialMLP's) and strips DDP/Float16
``module.`` prefixes; ``tp_split_dim`` says along which dimension a full tensor is split over TP ranks
(an expert's ``linear_fc1``/``linear_fc2`` like the dense MLP's: megatron-core's expert TP is the TP size).
A MoE layer's pre-MLP norm is its own module in both specs (``pre_mlp_layernorm.weight``, not fused).

Expert indices: a model names its experts by *local* index (0 .. experts per EP rank - 1); the canonical
names used everywhere else (converter, checkpoints, HF export) carry the *global* index, ``global_expert_name``
(global = EP rank * experts per rank + local). Used by the model builder (to mark TP parameters) and the
converter (``asyncrl.actor.convert``).

    canonical_megatron_name("module.decoder.layers.0.mlp.linear_fc1.layer_norm_weight")
    # -> "decoder.layers.0.pre_mlp_layernorm.weight"
    canonical_megatron_name("decoder.layers.1.mlp.experts.linear_fc2.weight3")
    # -> "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"
    tp_split_dim("decoder.layers.3.self_attention.linear_proj.weight")   # -> 1 (row-parallel)
"""

from __future__ import annotations

import re

LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
"""A decoder layer's parameter: group 1 the layer index, group 2 the layer-relative name."""
EXPERT_NAME = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
"""An expert's weight (canonical): group 1 the layer, group 2 the expert index, group 3 ``linear_fc1/2.weight``."""
_TE_GROUPED = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")
"""TE's grouped expert linears (``TEGroupedMLP``), layer-relative: group 1 the linear, group 2 the local expert."""

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
    if not m:
        return name
    rest = m.group(2)
    if rest in _TE_ALIASES:
        return f"decoder.layers.{m.group(1)}.{_TE_ALIASES[rest]}"
    g = _TE_GROUPED.match(rest)
    if g:
        return f"decoder.layers.{m.group(1)}.mlp.experts.local_experts.{g.group(2)}.{g.group(1)}.weight"
    return name


def layer_rest(name: str) -> str:
    """The layer-relative part of a decoder layer's parameter name (the name itself otherwise)."""
    m = LAYER_NAME.match(name)
    return m.group(2) if m else name


def is_expert(name: str) -> bool:
    """Whether a canonical name is an expert's weight (sharded over the EP ranks)."""
    return EXPERT_NAME.match(name) is not None


def global_expert_name(name: str, expert_offset: int) -> str:
    """A canonical expert name with local index ``e`` -> the one with ``expert_offset + e`` (others unchanged)."""
    m = EXPERT_NAME.match(name)
    if not m or expert_offset == 0:
        return name
    return f"decoder.layers.{m.group(1)}.mlp.experts.local_experts.{int(m.group(2)) + expert_offset}.{m.group(3)}"


def mlp_role(name: str) -> str:
    """The layer-relative role of a canonical name, an expert's linear named as the dense MLP's
    (``mlp.linear_fc1.weight`` / ``mlp.linear_fc2.weight``): the two are split and converted alike."""
    m = EXPERT_NAME.match(name)
    return f"mlp.{m.group(3)}" if m else layer_rest(name)


def tp_split_dim(mg_name: str) -> int | None:
    """0 for column-parallel (and vocab-parallel) tensors, 1 for row-parallel, None if replicated."""
    name = canonical_megatron_name(mg_name)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    rest = mlp_role(name)
    if rest in _COLUMN:
        return 0
    if rest in _ROW:
        return 1
    return None
