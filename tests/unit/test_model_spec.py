"""The one model description and the one safetensors reader (asyncrl.models.spec, asyncrl.models.safetensors_io):
errors name the field; a feature one consumer cannot run is refused by that consumer (and only that one), the same
way through its real loader; the plain decoder and the CPU engine compute the same logits with the features they
share (RoPE scaling, an o_proj bias)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from asyncrl.actor.checkpoint import hf_to_actor_checkpoint
from asyncrl.actor.memory import ModelShape
from asyncrl.actor.model import actor_spec
from asyncrl.cpu_engine.model import KVPool, load_model
from asyncrl.models.safetensors_io import SafetensorsReader, save_safetensors
from asyncrl.models.spec import ACTOR, CPU_ENGINE, TORCH_DECODER, ModelSpec
from asyncrl.models.tiny import make_tiny_checkpoint
from asyncrl.models.torch_decoder import TorchDecoder

BASE = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


@pytest.mark.parametrize(
    "change,field",
    [
        ({"hidden_size": None}, "hidden_size is missing"),
        ({"vocab_size": "64"}, "vocab_size='64' must be a positive integer"),
        ({"num_hidden_layers": 0}, "num_hidden_layers=0 must be a positive integer"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3 must divide num_attention_heads=4"),
        ({"hidden_size": 30}, "head_dim is missing and hidden_size=30"),
        ({"rms_norm_eps": -1}, "rms_norm_eps=-1 must be a positive number"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor is missing"),
        ({"rope_scaling": {"type": "linear"}}, "rope_scaling.factor is missing"),
        ({"model_type": "gpt2"}, "model_type='gpt2' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"use_sliding_window": True}, "use_sliding_window=true is not supported"),
        ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ],
)
def test_parse_errors_name_the_field(change, field):
    hf = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(ValueError, match="^cfg.json: " + field.replace("(", r"\(").replace("[", r"\[")):
        ModelSpec.from_hf_config(hf, where="cfg.json")


def test_one_reading_of_the_hf_fields():
    gen = {"eos_token_id": [2, 5]}
    s = ModelSpec.from_hf_config(
        {
            **BASE,
            "eos_token_id": 2,
            "attention_bias": True,
            "head_dim": 16,
            "rope_parameters": {"rope_theta": 5e5, **LLAMA3},
        },
        gen,
    )
    assert (s.ffn_hidden_size, s.num_layers, s.num_query_groups, s.head_dim) == (48, 2, 2, 16)
    assert s.qkv_bias and s.o_bias and not s.qk_norm and s.eos_token_ids == (2, 5)
    assert s.rope_theta == 5e5 and s.rope_scaling["rope_type"] == "llama3"  # transformers 5 layout
    q2 = ModelSpec.from_hf_config({**BASE, "model_type": "qwen2", "rope_scaling": {"type": "default"}})
    assert q2.qkv_bias and not q2.o_bias and q2.rope_scaling is None and q2.rope_theta == 10000.0
    assert ModelSpec.from_hf_config({**BASE, "model_type": "qwen3", "attention_bias": True}).o_bias
    shape = ModelShape.from_hf_config({**BASE, "model_type": "qwen3"})  # the memory estimate reads the same
    assert (shape.ffn_hidden_size, shape.num_query_groups, shape.qk_norm, shape.qkv_bias) == (48, 2, True, False)


@pytest.mark.parametrize(
    "extra,refused_by",
    [
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, {"actor"}),
        ({"rope_scaling": LLAMA3}, {"actor"}),
        ({"attention_bias": True}, {"actor"}),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, {"actor", "cpu", "decoder"}),
    ],
)
def test_each_consumer_refuses_what_it_cannot_run_through_its_loader(tmp_path, extra, refused_by):
    path = make_tiny_checkpoint(
        tmp_path / "m", arch="llama", num_hidden_layers=1, hidden_size=32, intermediate_size=48, **extra
    )
    loaders = {
        "actor": actor_spec,
        "cpu": load_model,
        "decoder": TorchDecoder.from_pretrained,
        "converter": lambda p: hf_to_actor_checkpoint(p, tmp_path / "ckpt"),
    }
    names = {"actor": ACTOR.name, "converter": ACTOR.name, "cpu": CPU_ENGINE.name, "decoder": TORCH_DECODER.name}
    refused_by = refused_by | ({"converter"} if "actor" in refused_by else set())
    for who, load in loaders.items():
        if who in refused_by:
            with pytest.raises(ValueError, match=f"config.json: .* is not supported by {re.escape(names[who])}") as e:
                load(path)
            assert ("rope_scaling.rope_type" if "rope_scaling" in extra else "attention_bias=true") in str(e.value)
        else:
            load(path)


@pytest.mark.parametrize(
    "extra",
    [{"rope_scaling": LLAMA3}, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, {"attention_bias": True}],
)
def test_plain_decoder_and_cpu_engine_agree_on_the_shared_features(tmp_path, extra):
    path = make_tiny_checkpoint(
        tmp_path / "m", arch="llama", seed=4, num_hidden_layers=2, hidden_size=32, intermediate_size=48, **extra
    )
    ids = torch.randint(0, 60, (1, 40), generator=torch.Generator().manual_seed(0))  # past the 16-token context
    with torch.no_grad():
        ours = TorchDecoder.from_pretrained(path)(ids)[0]
        eng = load_model(path)
        h = eng.forward(ids[0], torch.tensor([0]), torch.tensor([ids.shape[1]]), KVPool(eng.spec, 1), row0=0)
        theirs = eng.logits(h)
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(ours, ref(input_ids=ids).logits[0], atol=1e-4)


def test_one_safetensors_reader(tmp_path):
    a, b = {"x": torch.arange(3.0), "y": torch.ones(2, 2)}, {"z": torch.zeros(4)}
    d = tmp_path / "sharded"
    d.mkdir()
    save_file(a, str(d / "m-1.safetensors"))
    save_file(b, str(d / "m-2.safetensors"))
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "m-1.safetensors", "y": "m-1.safetensors", "z": "m-2.safetensors"}})
    )
    r = SafetensorsReader(d)
    assert r.keys() == ["x", "y", "z"] and "z" in r and torch.equal(r.get("x"), a["x"])
    assert {k: v.tolist() for k, v in r.items()} == {k: v.tolist() for k, v in {**a, **b}.items()}
    assert sorted(SafetensorsReader([d / "m-2.safetensors", d / "m-1.safetensors"]).to_dict()) == ["x", "y", "z"]
    with pytest.raises(KeyError, match="'w' is not in the safetensors of"):
        r.get("w")
    save_safetensors({"x": torch.arange(3.0)}, tmp_path / "one.safetensors")
    assert torch.equal(SafetensorsReader(tmp_path / "one.safetensors").get("x"), torch.arange(3.0))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no model.safetensors"):
        SafetensorsReader(tmp_path / "empty")
    with pytest.raises(ValueError, match="is missing"):
        SafetensorsReader(tmp_path / "absent.safetensors")


def test_the_launcher_refuses_a_model_before_any_process_starts(tmp_path):
    from pathlib import Path

    from asyncrl.config import ConfigError, load_config
    from asyncrl.runner.launcher import check_models

    tiny = Path(__file__).resolve().parents[2] / "configs/tiny.toml"
    kw = dict(arch="llama", num_hidden_layers=1, hidden_size=32, intermediate_size=48)
    plain = make_tiny_checkpoint(tmp_path / "plain", **kw)
    linear = make_tiny_checkpoint(tmp_path / "linear", **kw, rope_scaling={"rope_type": "linear", "factor": 2.0})
    yarn = make_tiny_checkpoint(tmp_path / "yarn", **kw, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    check_models(load_config(tiny, [f'actor.model_path="{plain}"', f'rollout.model_path="{linear}"']))
    with pytest.raises(ConfigError, match=r"^actor.model_path: .*rope_type='linear' is not supported by the actor"):
        check_models(load_config(tiny, [f'actor.model_path="{linear}"']))
    with pytest.raises(ConfigError, match=r"^rollout.model_path: .*rope_type='yarn' is not supported by the CPU en"):
        check_models(load_config(tiny, [f'actor.model_path="{plain}"', f'rollout.model_path="{yarn}"']))
    check_models(load_config(tiny, [f'actor.model_path="{tmp_path}/absent"']))  # made later by prepare: skipped


def test_an_unsupported_model_type_fails_the_dry_run_naming_the_key(tmp_path, monkeypatch, capsys):
    """A ``model_type`` outside the family (here Mistral) passed ``--dry-run`` with a warning ("actor memory not
    estimated") and failed deep in the run; it is a config error naming the key and the model_type, on the dry run
    and on a torchrun rank before any role starts. ``rollout.model_path`` is the CPU engine's to refuse: SGLang
    serves other families, so a GPU config keeps it."""
    from pathlib import Path

    from asyncrl.config import ConfigError, load_config
    from asyncrl.runner import launcher

    tiny = Path(__file__).resolve().parents[2] / "configs/tiny.toml"
    plain = make_tiny_checkpoint(tmp_path / "plain", arch="llama", num_hidden_layers=1, hidden_size=32)
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    (mistral / "config.json").write_text(json.dumps({**BASE, "model_type": "mistral"}))
    sentence = "config.json: model_type='mistral' is not supported (supported: qwen2, qwen3, llama, qwen3_moe)"
    assert launcher.main([str(tiny), f'actor.model_path="{mistral}"', "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"config error: actor.model_path: {mistral}/{sentence}" in err, err
    assert "actor memory not estimated" not in err  # the error, not a warning before it
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    started = []
    monkeypatch.setattr("asyncrl.runner.roles.run_role", lambda ctx: started.append(ctx) or 0)
    assert launcher.main([str(tiny), f'rollout.model_path="{mistral}"', f'actor.model_path="{plain}"']) == 2
    assert f"config error: rollout.model_path: {mistral}/{sentence}" in capsys.readouterr().err and not started
    gpu = [f'actor.model_path="{plain}"', f'rollout.model_path="{mistral}"', 'rollout.rollout_backend="sglang"']
    launcher.check_models(load_config(tiny, gpu))  # SGLang's to load
    with pytest.raises(ConfigError, match=r"^actor.model_path: .*model_type='mistral' is not supported"):
        launcher.check_models(load_config(tiny, [f'actor.model_path="{mistral}"', 'rollout.rollout_backend="sglang"']))


MOE = {
    **BASE,
    "model_type": "qwen3_moe",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "norm_topk_prob": True,
}


@pytest.mark.parametrize(
    "change,field",
    [
        ({"num_experts": None}, "num_local_experts is missing"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 is larger than num_experts=4"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size is missing"),
        ({"mlp_only_layers": [2]}, "mlp_only_layers has [2], outside the 2 layers"),
        ({"mlp_only_layers": "0"}, "mlp_only_layers='0' must be a list of layer indices"),
        ({"mlp_only_layers": [0, 1]}, "no layer is sparse"),
        ({"shared_expert_intermediate_size": 8}, "shared_expert_intermediate_size=8: shared experts are not supported"),
        ({"router_aux_loss_coef": -1}, "router_aux_loss_coef=-1 must be a number >= 0"),
    ],
)
def test_moe_parse_errors_name_the_field(change, field):
    hf = {k: v for k, v in {**MOE, **change}.items() if v is not None}
    with pytest.raises(ValueError) as e:
        ModelSpec.from_hf_config(hf, where="m/config.json")
    assert str(e.value).startswith("m/config.json: ") and field in str(e.value), str(e.value)


def test_moe_fields_follow_hf_rules():
    """Sparse layers by HF's rule (``mlp_only_layers`` dense, then every ``decoder_sparse_step``-th layer), the
    count under either name (transformers 5 writes ``num_local_experts``), the aux-loss coefficient's default."""
    spec = ModelSpec.from_hf_config({**MOE, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert spec.is_moe and spec.moe_layers == (1, 5) and spec.num_experts == 4 and spec.qk_norm
    assert [spec.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert spec.router_aux_loss_coef == 0.001 and spec.norm_topk_prob and spec.moe_ffn_hidden_size == 16
    local = {k: v for k, v in MOE.items() if k != "num_experts"} | {"num_local_experts": 8}
    assert ModelSpec.from_hf_config(local).num_experts == 8
    dense = ModelSpec.from_hf_config(BASE)
    assert not dense.is_moe and dense.moe_layers == () and not dense.is_moe_layer(0)
