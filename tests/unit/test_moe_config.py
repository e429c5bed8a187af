"""Mixture-of-experts settings before any process starts (issue #40): the expert grid, the checks against the model,
the plan and the per-rank memory estimate with experts per EP rank, and configs/qwen3_30b_a3b.toml's dry run.

The parameter and activation figures of the small spec below are worked out by hand in the comments; a real tiny
Qwen3-MoE checkpoint checks the count of every tensor at TP = EP = 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from asyncrl.actor.memory import (
    ModelShape,
    estimate_actor_memory,
    expert_params_per_rank,
    known_shape,
    params_per_rank,
)
from asyncrl.config import ConfigError, load_config, validate
from asyncrl.models.tiny import make_tiny_checkpoint
from asyncrl.runner import launcher

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs/tiny.toml"
QWEN3_30B = ROOT / "configs/qwen3_30b_a3b.toml"

# hidden 16, 2 heads of 8, 1 KV head, 4 experts of width 8 (top-2), layer 0 sparse, layer 1 dense (width 48)
SMALL = {
    "model_type": "qwen3_moe",
    "vocab_size": 256,
    "hidden_size": 16,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 8,
    "mlp_only_layers": [1],
    "tie_word_embeddings": False,
}
# TP 1: attention q 16x16 + k 8x16 + v 8x16 + o 16x16 = 768, norms 2 x 16, q/k norms 2 x 8 -> 816 a layer;
# layer 0: router 4 x 16 = 64, experts 4 x 3 x 8 x 16 = 1536; layer 1: dense MLP 3 x 48 x 16 = 2304;
# embedding + output 2 x 256 x 16 = 8192, final norm 16
DENSE_TP1 = 2 * 816 + 64 + 2304 + 8192 + 16  # 12208
EXPERTS_TP1 = 1536


def _small() -> ModelShape:
    return ModelShape.from_hf_config(SMALL)


def test_parameters_per_rank_split_dense_by_tp_and_experts_by_ep():
    s = _small()
    assert (params_per_rank(s, tp=1, pp=1), expert_params_per_rank(s, tp=1, pp=1)) == (13744, EXPERTS_TP1)
    assert DENSE_TP1 + EXPERTS_TP1 == 13744
    # EP 2: 2 of the 4 experts on the rank
    assert expert_params_per_rank(s, tp=1, pp=1, ep=2) == 768
    assert params_per_rank(s, tp=1, pp=1, ep=2) == DENSE_TP1 + 768
    # TP 2 x EP 2: attention 768 / 2 + 48 = 432 a layer, router 64 (replicated), dense MLP 2304 / 2, vocab 256 (a
    # multiple of 128 x 2) split in two: 2 x 2048, final norm 16; experts: 2 of 4, each split by the experts' TP 2
    assert expert_params_per_rank(s, tp=2, pp=1, ep=2) == 2 * 384 // 2
    assert params_per_rank(s, tp=2, pp=1, ep=2) == 2 * 432 + 64 + 1152 + 4096 + 16 + 384
    # PP 2: stage 0 = layer 0 (816 + 64 + 1536 = 2416), stage 1 = layer 1 (816 + 2304 = 3120): the dense stage is
    # the larger, no experts on it; plus one vocab matrix (4096) and the final norm
    assert params_per_rank(s, tp=1, pp=2) == 3120 + 4096 + 16
    assert expert_params_per_rank(s, tp=1, pp=2) == 0


def test_parameter_count_matches_a_tiny_qwen3_moe_checkpoint(tmp_path):
    d = make_tiny_checkpoint(
        tmp_path / "moe", arch="qwen3_moe", vocab_size=512, num_hidden_layers=2, mlp_only_layers=[1]
    )
    hf = json.loads((d / "config.json").read_text())
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    numel = {k: _prod(v) for k, v in shapes.items()}
    experts = sum(n for k, n in numel.items() if ".mlp.experts." in k)
    shape = ModelShape.from_hf_config(hf)
    padding = (-hf["vocab_size"]) % 128 * hf["hidden_size"] * 2  # untied: embedding and output padded
    assert expert_params_per_rank(shape, tp=1, pp=1) == experts > 0
    assert params_per_rank(shape, tp=1, pp=1) == sum(numel.values()) + padding
    assert expert_params_per_rank(shape, tp=1, pp=1, ep=4) * 4 == experts


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def test_memory_terms_of_an_moe_rank_by_hand():
    s = _small()
    kw = dict(tp=1, pp=1, dp=4, ep=2, bf16=True, microbatch_tokens=10, row_len=10)
    est = estimate_actor_memory(s, **kw)
    p = DENSE_TP1 + 768
    assert (est.params_per_rank, est.expert_params_per_rank, est.local_experts) == (p, 768, 2)
    assert (est.weights, est.grads, est.optimizer) == (2 * p, 4 * p, 12 * p)
    # the distributed optimizer: the dense part over DP 4, the experts over expert-DP 4 / 2 = 2
    assert estimate_actor_memory(s, **kw, distributed_optimizer=True).optimizer == 12 * DENSE_TP1 // 4 + 12 * 768 // 2
    # per token (bf16 elements): attention 6 x 16 + (4 + 6 + 2) x 8 + q/k norms 2 x 3 x 8 = 240; the MoE layer's
    # router logits and scores 2 x 4 + 2 routed copies x (16 + 4 x 8) = 104; the dense layer's MLP 4 x 48 = 192
    moe_layer, dense_layer = 10 * 2 * (240 + 104), 10 * 2 * (240 + 192)
    outside = 4 * 10 * 16 * 2  # embedding output, final norm's input, normalized values, output
    assert est.activations == moe_layer + dense_layer + outside
    full = estimate_actor_memory(s, **kw, recompute_granularity="full")
    assert full.activations == 2 * 10 * 16 * 2 + max(moe_layer, dense_layer) + outside
    assert est.logits == 10 * 256 * (2 * 2 + 16)
    assert "2 of the 4 experts of each MoE layer" in est.render()


def test_the_estimate_refuses_a_grid_it_cannot_place():
    with pytest.raises(ValueError, match="ep=3 must divide num_experts=4"):
        estimate_actor_memory(_small(), tp=1, pp=1, dp=6, ep=3, bf16=True, microbatch_tokens=8, row_len=8)
    with pytest.raises(ValueError, match="mixture-of-experts model"):
        estimate_actor_memory(
            known_shape("Qwen3-8B"), tp=1, pp=1, dp=2, ep=2, bf16=True, microbatch_tokens=8, row_len=8
        )


def test_a_dense_estimate_is_unchanged_by_the_expert_terms():
    s = known_shape("Qwen2.5-3B-Instruct")
    est = estimate_actor_memory(s, tp=2, pp=1, dp=4, bf16=True, microbatch_tokens=16384, row_len=4096)
    assert (est.expert_params_per_rank, est.local_experts) == (0, 0) and "experts" not in est.render()
    assert est.params_per_rank == params_per_rank(s, tp=2, pp=1)


def test_known_qwen3_30b_a3b_is_its_published_config():
    s = known_shape("models/Qwen3-30B-A3B")
    assert (s.hidden_size, s.num_layers, s.num_attention_heads, s.num_query_groups, s.head_dim) == (
        2048,
        48,
        32,
        4,
        128,
    )
    assert (s.num_experts, s.num_experts_per_tok, s.moe_ffn_hidden_size, s.ffn_hidden_size) == (128, 8, 768, 6144)
    assert (s.vocab_size, s.tie_word_embeddings, s.moe_layers) == (151936, False, tuple(range(48)))
    assert round(params_per_rank(s, tp=1, pp=1) / 1e8) == 305  # "30.5B"
    # EP 8: 16 experts of each layer, 48 x 16 x 3 x 768 x 2048
    assert expert_params_per_rank(s, tp=1, pp=1, ep=8) == 48 * 16 * 3 * 768 * 2048


def _cfg(*overrides: str, world: int = 5):
    """tiny.toml with 4 actor ranks (0-3) and one rollout rank."""
    place = 'cluster.component_placement={actor = "0-3", "rollout,reward" = "4"}'
    return load_config(TINY, [place, f"cluster.num_devices_per_node={world}", *overrides])


@pytest.mark.parametrize(
    "tp,ep,ok",
    [(1, 4, True), (2, 2, True), (4, 1, True), (1, 3, False), (2, 4, False), (1, 8, False)],
)
def test_the_expert_grid_must_divide_the_actor_ranks(tp, ep, ok):
    cfg = _cfg(f"actor.tensor_model_parallel_size={tp}", f"actor.expert_model_parallel_size={ep}")
    if ok:
        validate(cfg, world_size=5)
        return
    with pytest.raises(ConfigError, match=rf"^actor.expert_model_parallel_size: TP {tp} x EP {ep} x PP 1 = {tp * ep} "):
        validate(cfg, world_size=5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    kw = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=48)
    return {
        "moe": make_tiny_checkpoint(d / "moe", arch="qwen3_moe", **kw),  # 8 experts
        "dense": make_tiny_checkpoint(d / "dense", arch="qwen3", **kw),
    }


def test_check_models_refuses_expert_settings_the_model_does_not_fit(models):
    moe, dense = models["moe"], models["dense"]
    launcher.check_models(_cfg(f'actor.model_path="{moe}"', "actor.expert_model_parallel_size=4"))
    launcher.check_models(_cfg(f'actor.model_path="{moe}"', "actor.moe_aux_loss_coeff=0.0"))
    with pytest.raises(ConfigError, match=r"^actor.expert_model_parallel_size: EP 3 does not divide the 8 experts of "):
        launcher.check_models(_cfg(f'actor.model_path="{moe}"', "actor.expert_model_parallel_size=3"))
    with pytest.raises(ConfigError, match=r"^actor.expert_model_parallel_size: EP 2 is for MoE models only; .*dense"):
        launcher.check_models(_cfg(f'actor.model_path="{dense}"', "actor.expert_model_parallel_size=2"))
    with pytest.raises(ConfigError, match=r"^actor.moe_aux_loss_coeff: 0.0 is for MoE models only"):
        launcher.check_models(_cfg(f'actor.model_path="{dense}"', "actor.moe_aux_loss_coeff=0.0"))
    with pytest.raises(ConfigError, match=r"^actor.tensor_model_parallel_size: TP 2 with the mixture-of-experts model"):
        launcher.check_models(_cfg(f'actor.model_path="{moe}"', "actor.tensor_model_parallel_size=2"))
    launcher.check_models(_cfg(f'actor.model_path="{dense}"', "actor.tensor_model_parallel_size=2"))
    launcher.check_models(_cfg(f'actor.model_path="{moe}"', "actor.moe_routing_replay=true"))
    with pytest.raises(ConfigError, match=r"^actor.moe_routing_replay: routing replay is for MoE models only; .*dense"):
        launcher.check_models(_cfg(f'actor.model_path="{dense}"', "actor.moe_routing_replay=true"))
    # a known public model is checked by name before it is downloaded
    with pytest.raises(ConfigError, match=r"the known shape of Qwen3-8B is a dense model"):
        launcher.check_models(_cfg('actor.model_path="models/Qwen3-8B"', "actor.expert_model_parallel_size=2"))


def test_the_brokers_frame_cap_counts_the_routed_experts(models):
    from asyncrl.broker.serve import max_message_bytes

    off = _cfg(f'actor.model_path="{models["moe"]}"')
    on = _cfg(f'actor.model_path="{models["moe"]}"', "actor.moe_routing_replay=true")
    tokens = max(off.agentloop.max_total_tokens, off.data.max_prompt_tokens)
    trajectories = 2 * max(256, off.rollout_buffer.max_buffered_groups) * off.algorithm.group_size  # doubled
    # the fixture's model: 1 layer, top-2 of 8 experts: 8 bytes a position
    assert max_message_bytes(on) - max_message_bytes(off) == pytest.approx(trajectories * tokens * 8, abs=4 * 4096)


def test_routing_replay_refuses_full_recompute_under_a_pipeline():
    replay = ("actor.moe_routing_replay=true", 'actor.recompute_granularity="full"')
    validate(_cfg(*replay), world_size=5)  # PP = 1: a layer's recompute follows its forward
    with pytest.raises(ConfigError, match=r"^actor.moe_routing_replay: not with full activation recompute at "):
        validate(_cfg(*replay, "actor.pipeline_model_parallel_size=2"), world_size=5)


def test_dry_run_prints_the_expert_grid_and_the_experts_per_rank(models, capsys, monkeypatch):
    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "GROUP_RANK", "NODE_RANK", "SLURM_NODEID"):
        monkeypatch.delenv(key, raising=False)
    place = 'cluster.component_placement={actor = "0-3", "rollout,reward" = "4"}'
    args = [str(TINY), place, "cluster.num_devices_per_node=5", f'actor.model_path="{models["moe"]}"']
    assert launcher.main([*args, "actor.expert_model_parallel_size=2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "actor TP 1 x PP 1 x DP 4; experts EP 2 x expert-DP 2 (expert TP = TP 1): 4 of the 8 experts" in out
    assert "dense + " in out and "in 4 of the 8 experts of each MoE layer" in out
    assert launcher.main([*args, "actor.expert_model_parallel_size=3", "--dry-run"]) == 2
    assert "config error: actor.expert_model_parallel_size: TP 1 x EP 3 x PP 1 = 3" in capsys.readouterr().err
    dense = [str(TINY), place, "cluster.num_devices_per_node=5", f'actor.model_path="{models["dense"]}"']
    assert launcher.main([*dense, "--dry-run"]) == 0
    assert "experts" not in capsys.readouterr().out  # a dense plan and estimate as before
    # EP set and a model not read yet (configs/tiny_moe.toml's is made by prepare): the grid without the count
    absent = f'actor.model_path="{models["moe"].parent / "absent"}"'
    assert launcher.main([str(ROOT / "configs/tiny_moe.toml"), absent, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "actor TP 1 x PP 1 x DP 2; experts EP 2 x expert-DP 1 (expert TP = TP 1)\n" in out


def _clean_env() -> dict[str, str]:
    drop = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "MASTER_ADDR", "GROUP_RANK", "NODE_RANK")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}


def test_qwen3_30b_a3b_config_dry_run():
    """The shipped config, through the real entry point as the other GPU configs are: the seed's placement (actor
    on node 0 with EP 8, one SGLang engine over node 1's 8 GPUs), the experts per EP rank in the estimate, and the
    refusal at 80 GB that names EP among the keys that shrink it."""
    train = [sys.executable, str(ROOT / "launch/train.py"), str(QWEN3_30B), "--dry-run"]
    r = subprocess.run(train, cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "# plan: 16 ranks, mode async, 1 engine(s), actor TP 1 x PP 1 x DP 8; experts EP 8 x expert-DP 1" in out
    assert "16 of the 128 experts of each MoE layer on a rank" in out
    assert "\n7     0     actor    cuda:7        actor rank 7/8\n" in out
    assert "\n8     1     rollout  cuda:0        engine 0 (SGLang server, TP 8) launcher + agent worker\n" in out
    memory = next(line for line in out.splitlines() if line.startswith("# actor memory"))
    assert "the known shape of Qwen3-30B-A3B" in memory and "in 16 of the 128 experts of each MoE layer" in memory
    total = float(memory.split("-> total ")[1].split(" GiB")[0])
    assert 0.9 * 80 < total < 0.9 * 141 and "fits 126.9 GiB" in memory  # an H200 fits it, an 80 GB GPU does not
    cfg = load_config(QWEN3_30B)
    assert cfg.runner.async_mode and cfg.rollout.tensor_parallel_size == 8 and cfg.actor.expert_model_parallel_size == 8
    small = subprocess.run(
        [*train, "cluster.device_memory_gb=80"], cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=300
    )
    assert small.returncode == 2 and "actor.expert_model_parallel_size" in small.stderr, small.stderr


def test_sglang_refuses_a_qwen3_moe_with_dense_layers(tmp_path):
    """SGLang 0.5.23 makes every Qwen3-MoE layer sparse and drops a dense layer's MLP (checked with its own loader
    in tools/check_sglang.py): such a model is a config error for the SGLang backend, not for the CPU engine."""
    tiny = Path(__file__).resolve().parents[2] / "configs/tiny.toml"
    mixed = make_tiny_checkpoint(tmp_path / "mixed", arch="qwen3_moe", num_hidden_layers=2, mlp_only_layers=[1])
    sparse = make_tiny_checkpoint(tmp_path / "sparse", arch="qwen3_moe", num_hidden_layers=2)
    gpu = ['rollout.rollout_backend="sglang"']
    with pytest.raises(ConfigError, match=r"^rollout.model_path: .*dense layers \[1\].*SGLang 0.5.23 builds every"):
        launcher.check_models(load_config(tiny, [*gpu, f'actor.model_path="{mixed}"']))
    launcher.check_models(load_config(tiny, [*gpu, f'actor.model_path="{sparse}"']))
    launcher.check_models(load_config(tiny, [f'actor.model_path="{mixed}"']))  # the CPU engine serves it
