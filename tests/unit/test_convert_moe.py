"""HF <-> Megatron conversion of Qwen3-MoE (pure): exact round trips at TP 1 and 2, mixed dense/sparse layers,
TE grouped-expert names, the converted checkpoint's keys, the EP/TP checks and the MoE TransformerConfig keywords."""

import json

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.actor.checkpoint import actor_checkpoint_to_hf, hf_to_actor_checkpoint
from asyncrl.actor.convert import (
    hf_names_for,
    hf_state_to_megatron,
    megatron_param_names,
    megatron_state_to_hf,
    tp_merge,
    tp_shard,
)
from asyncrl.actor.model import check_parallel_sizes, check_trainable, moe_settings
from asyncrl.actor.moe import summarize
from asyncrl.actor.names import canonical_megatron_name, global_expert_name, tp_split_dim
from asyncrl.models.spec import ModelSpec
from asyncrl.models.tiny import make_tiny_checkpoint


@pytest.mark.parametrize("overrides", [{}, {"num_hidden_layers": 2, "mlp_only_layers": [1]}], ids=["sparse", "mixed"])
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_megatron_hf_exact(tmp_path, overrides, tp):
    hf = make_tiny_checkpoint(tmp_path, arch="qwen3_moe", **overrides)
    spec = ModelSpec.from_pretrained(hf)
    sd = load_file(str(hf / "model.safetensors"))
    mg = hf_state_to_megatron(sd, spec, tp=tp)
    assert list(mg) == megatron_param_names(spec)
    p = "decoder.layers.0.mlp."
    assert torch.equal(mg[p + "router.weight"], sd["model.layers.0.mlp.gate.weight"])  # [experts, hidden]
    fc1 = mg[p + "experts.local_experts.5.linear_fc1.weight"]  # gate rows, then up rows
    gate, up = sd["model.layers.0.mlp.experts.5.gate_proj.weight"], sd["model.layers.0.mlp.experts.5.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate, up]))
    assert torch.equal(
        mg[p + "experts.local_experts.7.linear_fc2.weight"], sd["model.layers.0.mlp.experts.7.down_proj.weight"]
    )
    if overrides:  # layer 1 is dense: today's names
        assert "decoder.layers.1.mlp.linear_fc1.weight" in mg and "decoder.layers.1.mlp.router.weight" not in mg
        assert not any(k.startswith("decoder.layers.1.mlp.experts") for k in mg)
    shards = {k: [tp_shard(k, v, rank=r, tp=tp) for r in range(tp)] for k, v in mg.items()}
    if tp == 2:  # an expert's fc1 is split like the dense MLP's (gate and up separately); the router is replicated
        half = spec.moe_ffn_hidden_size // 2
        assert torch.equal(
            shards[p + "experts.local_experts.5.linear_fc1.weight"][1], torch.cat([gate[half:], up[half:]])
        )
        assert shards[p + "experts.local_experts.5.linear_fc2.weight"][0].shape == (spec.hidden_size, half)
        assert shards[p + "router.weight"][1] is mg[p + "router.weight"]
    back = dict(megatron_state_to_hf({k: tp_merge(k, s) for k, s in shards.items()}, spec))
    assert sorted(back) == sorted(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_names_listed_are_the_checkpoint_keys_and_convert_back(tmp_path):
    hf = make_tiny_checkpoint(tmp_path / "hf", arch="qwen3_moe", num_hidden_layers=2, mlp_only_layers=[1])
    spec = ModelSpec.from_pretrained(hf)
    hf_to_actor_checkpoint(hf, tmp_path / "ckpt", tp=2)
    for r in range(2):
        assert sorted(load_file(str(tmp_path / "ckpt" / f"model_tp{r:02d}.safetensors"))) == sorted(
            megatron_param_names(spec)
        )
    assert sorted(p for n in megatron_param_names(spec) for p in hf_names_for(n, spec)) == sorted(
        load_file(str(hf / "model.safetensors"))
    )
    actor_checkpoint_to_hf(tmp_path / "ckpt", tmp_path / "back")
    a, b = load_file(str(hf / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_te_grouped_expert_names_and_global_indices():
    te = "module.decoder.layers.3.mlp.experts.linear_fc1.weight2"
    assert canonical_megatron_name(te) == "decoder.layers.3.mlp.experts.local_experts.2.linear_fc1.weight"
    assert canonical_megatron_name("decoder.layers.3.mlp.experts.linear_fc2.weight11") == (
        "decoder.layers.3.mlp.experts.local_experts.11.linear_fc2.weight"
    )
    assert tp_split_dim(te) == 0 and tp_split_dim("decoder.layers.3.mlp.experts.linear_fc2.weight0") == 1
    assert tp_split_dim("decoder.layers.3.mlp.router.weight") is None
    local = "decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight"
    assert global_expert_name(local, 4) == "decoder.layers.3.mlp.experts.local_experts.5.linear_fc2.weight"
    assert global_expert_name("decoder.layers.3.mlp.router.weight", 4) == "decoder.layers.3.mlp.router.weight"


def _spec(tmp_path, **overrides) -> ModelSpec:
    cfg = json.loads((make_tiny_checkpoint(tmp_path, arch="qwen3_moe") / "config.json").read_text())
    return ModelSpec.from_hf_config({**cfg, **overrides})


def test_expert_parallel_sizes_are_checked_by_name(tmp_path):
    spec = _spec(tmp_path)
    check_parallel_sizes(spec, tp=2, pp=2, ep=8)
    with pytest.raises(ValueError, match=r"actor.expert_model_parallel_size=3 must divide num_experts=8"):
        check_parallel_sizes(spec, tp=1, pp=1, ep=3)
    with pytest.raises(ValueError, match=r"actor.tensor_model_parallel_size=3 must divide"):
        check_parallel_sizes(spec, tp=3, pp=1)
    dense = ModelSpec.from_hf_config(json.loads((make_tiny_checkpoint(tmp_path / "d") / "config.json").read_text()))
    with pytest.raises(ValueError, match=r"actor.expert_model_parallel_size=2: qwen2 is a dense model"):
        check_parallel_sizes(dense, tp=1, pp=1, ep=2)
    check_trainable(dense, tp=2)
    with pytest.raises(ValueError, match=r"actor.tensor_model_parallel_size=2 with a mixture-of-experts model"):
        check_trainable(spec, tp=2)


def test_moe_settings_are_qwen3_moe_routing(tmp_path):
    spec = _spec(tmp_path, num_hidden_layers=3, mlp_only_layers=[1], router_aux_loss_coef=0.02)
    s = moe_settings(spec, ep=2, aux_loss_coeff=None, grouped_gemm=False)
    assert s["moe_layer_freq"] == [1, 0, 1] and s["num_moe_experts"] == 8 and s["moe_router_topk"] == 2
    assert s["moe_router_pre_softmax"] is False  # norm_topk_prob: softmax over the top-k logits
    assert s["moe_aux_loss_coeff"] == 0.02 and s["moe_router_load_balancing_type"] == "aux_loss"
    assert s["expert_model_parallel_size"] == 2 and s["moe_router_dtype"] == "fp32"
    off = moe_settings(spec, ep=1, aux_loss_coeff=0.0, grouped_gemm=True)
    assert off["moe_router_load_balancing_type"] == "none" and off["moe_grouped_gemm"] is True
    assert moe_settings(_spec(tmp_path / "n", norm_topk_prob=False), ep=1, aux_loss_coeff=None, grouped_gemm=False)[
        "moe_router_pre_softmax"
    ]
    with pytest.raises(ValueError, match="actor.moe_aux_loss_coeff=-1"):
        moe_settings(spec, ep=1, aux_loss_coeff=-1, grouped_gemm=False)
    with pytest.raises(ValueError, match="num_experts_per_tok=1 with norm_topk_prob=true"):
        moe_settings(_spec(tmp_path / "k", num_experts_per_tok=1), ep=1, aux_loss_coeff=None, grouped_gemm=False)


def test_routing_summary():
    counts = torch.tensor([[4.0, 4.0, 4.0, 4.0], [8.0, 4.0, 4.0, 0.0]], dtype=torch.float64)
    m = summarize(counts, aux_sum=3.0, num_microbatches=3)
    assert m["moe/expert_load/max_over_mean"] == pytest.approx((1.0 + 2.0) / 2)
    assert m["moe/expert_load/min_over_mean"] == pytest.approx((1.0 + 0.0) / 2)
    assert m["moe/aux_loss"] == pytest.approx(3.0 / (3 * 2))
    assert [m[f"moe/expert_load/expert_{e}"] for e in range(4)] == pytest.approx([12 / 32, 8 / 32, 8 / 32, 4 / 32])
    assert "moe/aux_loss" not in summarize(counts, aux_sum=None, num_microbatches=3)
    many = summarize(torch.ones(1, 17, dtype=torch.float64), aux_sum=None, num_microbatches=1)
    assert many["moe/expert_load/max_over_mean"] == 1.0 and not any("load/expert_" in k for k in many)
