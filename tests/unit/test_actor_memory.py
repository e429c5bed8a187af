"""The actor's per-rank memory estimate (pure) and the launcher's refusal of a GPU plan that cannot fit."""

import json

import pytest
from safetensors import safe_open

from asyncrl.actor.memory import GIB, ModelShape, estimate_actor_memory, known_shape, params_per_rank
from asyncrl.config import ConfigError, load_config
from asyncrl.config.placement import parse_placement
from asyncrl.models.tiny import make_tiny_checkpoint
from asyncrl.runner.launcher import actor_memory


def test_known_models_parameter_counts():
    # the published parameter counts (vocab 151936 is a multiple of 128: no padding at TP=1)
    assert params_per_rank(known_shape("models/Qwen2.5-0.5B-Instruct"), tp=1, pp=1) == 494_032_768
    assert params_per_rank(known_shape("Qwen2.5-7B"), tp=1, pp=1) == 7_615_616_512
    assert known_shape("some/unknown-model") is None


@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("qwen3", True), ("llama", False)])
def test_parameter_count_matches_a_checkpoint(tmp_path, arch, tied):
    d = make_tiny_checkpoint(tmp_path / arch, arch=arch, tie_word_embeddings=tied, vocab_size=512)
    hf = json.loads((d / "config.json").read_text())
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        numel = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())
    shape = ModelShape.from_hf_config(hf)
    padding = (-hf["vocab_size"]) % 128 * hf["hidden_size"] * (1 if tied else 2)
    assert params_per_rank(shape, tp=1, pp=1) == numel + padding


def _prod(xs):
    out = 1
    for x in xs:
        out *= x
    return out


def test_estimate_terms_move_the_right_way():
    s = known_shape("Qwen2.5-3B-Instruct")
    kw = dict(tp=2, pp=1, dp=4, bf16=True, microbatch_tokens=16384, row_len=4096, ref_model=True)
    base = estimate_actor_memory(s, **kw)
    p = base.params_per_rank
    assert (base.weights, base.grads, base.optimizer, base.ref_weights) == (2 * p, 4 * p, 12 * p, 2 * p)
    assert estimate_actor_memory(s, **{**kw, "distributed_optimizer": True}).optimizer == 3 * p
    full = estimate_actor_memory(s, **kw, recompute_granularity="full")
    assert full.activations < base.activations / 8 and full.weights == base.weights
    unfused = estimate_actor_memory(s, **kw, attention="unfused")
    assert unfused.activations > 3 * base.activations  # the [heads, S, S] probabilities per layer
    assert (
        estimate_actor_memory(s, **kw, attention="unfused", recompute_granularity="selective").activations
        == base.activations
    )
    half = estimate_actor_memory(s, **{**kw, "microbatch_tokens": 8192})
    assert half.activations < base.activations and half.logits * 2 == base.logits
    assert estimate_actor_memory(s, **{**kw, "tp": 4}).total < base.total
    assert 40 * GIB < base.total < 120 * GIB and "total" in base.render()


def _searchr1(*overrides):
    cfg = load_config("configs/searchr1.toml", list(overrides))
    placement = parse_placement(
        cfg.cluster.component_placement, world_size=16, engine_tp=cfg.rollout.tensor_parallel_size
    )
    return cfg, placement


def test_launcher_prints_and_refuses_by_the_estimate():
    line = actor_memory(*_searchr1())
    assert "Qwen2.5-3B-Instruct" in line and "fits" in line
    with pytest.raises(ConfigError, match="actor.recompute_granularity") as e:
        actor_memory(*_searchr1("actor.recompute_granularity=none"))
    assert "cluster.device_memory_gb" in str(e.value) and "actor.max_tokens_per_microbatch" in str(e.value)
    assert "fits" in actor_memory(*_searchr1("actor.recompute_granularity=none", "cluster.device_memory_gb=141"))
    with pytest.raises(ConfigError, match="cluster.device_memory_gb"):
        _searchr1("cluster.device_memory_gb=0")
    unknown = actor_memory(*_searchr1("actor.model_path=models/secret"))
    assert "not estimated" in unknown
