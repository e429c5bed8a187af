"""HF <-> Megatron parameter conversion for Qwen2/Qwen2.5, Qwen3, Llama and Qwen3-MoE (pure functions + CLI).

Names (megatron-core 0.16.1, local layer spec; the transformer-engine spec's fused-norm names are
accepted too, see ``canonical_megatron_name``)::

    model.embed_tokens.weight                 <-> embedding.word_embeddings.weight   (vocab padded)
    model.layers.N.input_layernorm.weight     <-> decoder.layers.N.input_layernorm.weight
    model.layers.N.self_attn.{q,k,v}_proj.*   <-> decoder.layers.N.self_attention.linear_qkv.*
        (rows grouped per query group: that group's q heads, then its k head, then its v head)
    model.layers.N.self_attn.{q,k}_norm.weight<-> decoder.layers.N.self_attention.{q,k}_layernorm.weight
    model.layers.N.self_attn.o_proj.weight    <-> decoder.layers.N.self_attention.linear_proj.weight
    model.layers.N.post_attention_layernorm   <-> decoder.layers.N.pre_mlp_layernorm.weight
    model.layers.N.mlp.{gate,up}_proj.weight  <-> decoder.layers.N.mlp.linear_fc1.weight (gate rows, then up)
    model.layers.N.mlp.down_proj.weight       <-> decoder.layers.N.mlp.linear_fc2.weight
    (Qwen3-MoE sparse layers, ``spec.is_moe_layer(N)``; E = the global expert index; dense layers as above)
    model.layers.N.mlp.gate.weight            <-> decoder.layers.N.mlp.router.weight     ([experts, hidden])
    model.layers.N.mlp.experts.E.{gate,up}_proj.weight
                                <-> decoder.layers.N.mlp.experts.local_experts.E.linear_fc1.weight (gate, then up)
    model.layers.N.mlp.experts.E.down_proj.weight
                                <-> decoder.layers.N.mlp.experts.local_experts.E.linear_fc2.weight
    model.norm.weight                         <-> decoder.final_layernorm.weight
    lm_head.weight                            <-> output_layer.weight                (vocab padded; absent if tied)

A "full" Megatron tensor is the unsharded one; ``tp_shard``/``tp_merge`` split and join it the
way megatron-core's column/row-parallel layers do (``linear_fc1`` shards gate and up separately; an
expert's linears like the dense MLP's; the router is replicated). Expert names carry global indices
(``asyncrl.actor.names``); which EP rank holds an expert is the actor's business (``asyncrl.actor.weights``).

CLI (for users): ``python -m asyncrl.actor.convert_cli`` (outside this module, which the checkpoint code
imports). Megatron names and TP split dimensions: ``asyncrl.actor.names``.

The actor checkpoint format is described in ``asyncrl.actor.checkpoint``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from asyncrl.actor.model import padded_vocab_size
from asyncrl.actor.names import EXPERT_NAME, LAYER_NAME, canonical_megatron_name, mlp_role, tp_split_dim
from asyncrl.models.spec import ModelSpec


def _pad_vocab(t: torch.Tensor, padded: int) -> torch.Tensor:
    if t.shape[0] == padded:
        return t
    assert t.shape[0] < padded, (t.shape, padded)
    pad = torch.zeros((padded - t.shape[0], *t.shape[1:]), dtype=t.dtype)
    return torch.cat([t, pad], dim=0)


def _qkv_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    ng, hd = spec.num_query_groups, spec.head_dim
    per = spec.num_attention_heads // ng
    tail = q.shape[1:]
    qg = q.reshape(ng, per * hd, *tail)
    kg = k.reshape(ng, hd, *tail)
    vg = v.reshape(ng, hd, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(ng * (per + 2) * hd, *tail).contiguous()


def _qkv_split(qkv: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ng, hd = spec.num_query_groups, spec.head_dim
    per = spec.num_attention_heads // ng
    tail = qkv.shape[1:]
    g = qkv.reshape(ng, (per + 2) * hd, *tail)
    q, k, v = torch.split(g, [per * hd, hd, hd], dim=1)
    return (
        q.reshape(ng * per * hd, *tail).contiguous(),
        k.reshape(ng * hd, *tail).contiguous(),
        v.reshape(ng * hd, *tail).contiguous(),
    )


def megatron_param_names(spec: ModelSpec) -> list[str]:
    """Full-model Megatron parameter names (local spec), in model order."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(spec.num_layers):
        p = f"decoder.layers.{i}."
        names.append(p + "input_layernorm.weight")
        names.append(p + "self_attention.linear_qkv.weight")
        if spec.qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        if spec.qk_norm:
            names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
        names.append(p + "self_attention.linear_proj.weight")
        names.append(p + "pre_mlp_layernorm.weight")
        if spec.is_moe_layer(i):
            names.append(p + "mlp.router.weight")
            for e in range(spec.num_experts):
                names += [p + f"mlp.experts.local_experts.{e}.linear_fc{k}.weight" for k in (1, 2)]
        else:
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    names.append("decoder.final_layernorm.weight")
    if not spec.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def hf_names_for(mg_name: str, spec: ModelSpec) -> list[str]:
    """The HF tensors one full Megatron tensor is made of (in merge order)."""
    name = canonical_megatron_name(mg_name)
    if name == "embedding.word_embeddings.weight":
        return ["model.embed_tokens.weight"]
    if name == "decoder.final_layernorm.weight":
        return ["model.norm.weight"]
    if name == "output_layer.weight":
        return ["lm_head.weight"]
    x = EXPERT_NAME.match(name)
    if x:
        p = f"model.layers.{x.group(1)}.mlp.experts.{x.group(2)}."
        return (
            [p + "gate_proj.weight", p + "up_proj.weight"]
            if x.group(3) == "linear_fc1.weight"
            else [p + "down_proj.weight"]
        )
    m = LAYER_NAME.match(name)
    if not m:
        raise KeyError(f"unknown Megatron parameter {mg_name!r}")
    i, rest = m.group(1), m.group(2)
    p = f"model.layers.{i}."
    table = {
        "input_layernorm.weight": [p + "input_layernorm.weight"],
        "self_attention.linear_qkv.weight": [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
        "self_attention.linear_qkv.bias": [p + f"self_attn.{x}_proj.bias" for x in "qkv"],
        "self_attention.q_layernorm.weight": [p + "self_attn.q_norm.weight"],
        "self_attention.k_layernorm.weight": [p + "self_attn.k_norm.weight"],
        "self_attention.linear_proj.weight": [p + "self_attn.o_proj.weight"],
        "pre_mlp_layernorm.weight": [p + "post_attention_layernorm.weight"],
        "mlp.linear_fc1.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
        "mlp.linear_fc2.weight": [p + "mlp.down_proj.weight"],
        "mlp.router.weight": [p + "mlp.gate.weight"],
    }
    if rest not in table:
        raise KeyError(f"unknown Megatron parameter {mg_name!r}")
    return table[rest]


def hf_to_megatron(mg_name: str, hf_tensors: list[torch.Tensor], spec: ModelSpec, *, tp: int) -> torch.Tensor:
    """Build the full Megatron tensor ``mg_name`` from its HF parts (``hf_names_for`` order)."""
    name = canonical_megatron_name(mg_name)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        (t,) = hf_tensors
        if t.shape[0] != spec.vocab_size:
            raise ValueError(
                f"{hf_names_for(name, spec)[0]} has {t.shape[0]} rows, config.json vocab_size={spec.vocab_size}"
            )
        return _pad_vocab(t, padded_vocab_size(spec.vocab_size, tp))
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return _qkv_merge(*hf_tensors, spec)
    if name.endswith("linear_fc1.weight"):
        return torch.cat(hf_tensors, dim=0).contiguous()
    (t,) = hf_tensors
    return t


def megatron_to_hf(mg_name: str, full: torch.Tensor, spec: ModelSpec) -> list[tuple[str, torch.Tensor]]:
    """Split one full Megatron tensor into its HF-named tensors (vocab padding stripped)."""
    name = canonical_megatron_name(mg_name)
    hf = hf_names_for(name, spec)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return [(hf[0], full[: spec.vocab_size].contiguous())]
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return list(zip(hf, _qkv_split(full, spec)))
    if name.endswith("linear_fc1.weight"):
        gate, up = torch.chunk(full, 2, dim=0)
        return [(hf[0], gate.contiguous()), (hf[1], up.contiguous())]
    return [(hf[0], full)]


def tp_shard(mg_name: str, full: torch.Tensor, *, rank: int, tp: int) -> torch.Tensor:
    """This TP rank's shard of a full Megatron tensor."""
    dim = tp_split_dim(mg_name)
    if dim is None or tp == 1:
        return full
    if mlp_role(canonical_megatron_name(mg_name)) == "mlp.linear_fc1.weight":
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0).contiguous()
    if full.shape[dim] % tp:
        raise ValueError(f"{mg_name}: dim {dim} of size {full.shape[dim]} is not divisible by TP={tp}")
    return full.chunk(tp, dim=dim)[rank].contiguous()


def tp_merge(mg_name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of ``tp_shard`` over all TP ranks' shards (in rank order)."""
    dim = tp_split_dim(mg_name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if mlp_role(canonical_megatron_name(mg_name)) == "mlp.linear_fc1.weight":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0).contiguous()
    return torch.cat(shards, dim=dim).contiguous()


def hf_state_to_megatron(hf_sd: dict[str, torch.Tensor], spec: ModelSpec, *, tp: int) -> dict[str, torch.Tensor]:
    """Whole HF state dict -> full Megatron state dict (unsharded, vocab padded for ``tp``)."""
    out = {}
    used = set()
    for name in megatron_param_names(spec):
        parts = hf_names_for(name, spec)
        missing = [p for p in parts if p not in hf_sd]
        if missing:
            raise KeyError(f"HF checkpoint lacks {missing} (needed for {name})")
        used.update(parts)
        out[name] = hf_to_megatron(name, [hf_sd[p] for p in parts], spec, tp=tp)
    ignorable = {"lm_head.weight"} if spec.tie_word_embeddings else set()
    extra = sorted(k for k in set(hf_sd) - used - ignorable if not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise KeyError(f"HF checkpoint has tensors the {spec.model_type} converter does not know: {extra[:5]}")
    return out


def megatron_state_to_hf(mg_sd: dict[str, torch.Tensor], spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in mg_sd.items():
        yield from megatron_to_hf(name, t, spec)


if __name__ == "__main__":  # ``python -m asyncrl.actor.convert``: this module is the mapping, not the CLI
    import sys

    print(
        "asyncrl.actor.convert is the HF <-> Megatron tensor mapping (a library; it runs nothing). The converter:\n"
        "  python -m asyncrl.actor.convert_cli hf-to-actor --hf DIR --out CKPT [--tp N]\n"
        "  python -m asyncrl.actor.convert_cli actor-to-hf --ckpt CKPT --out DIR\n"
        "  python -m asyncrl.actor.convert_cli --help",
        file=sys.stderr,
    )
    sys.exit(2)
