"""HF <-> Megatron conversion: exact round trips (pure), TP sharding, the CLI, bucketing."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.actor.convert import (
    hf_state_to_megatron,
    megatron_param_names,
    megatron_state_to_hf,
    tp_merge,
    tp_shard,
)
from asyncrl.actor.convert_cli import main, parser
from asyncrl.actor.model import ModelSpec, padded_vocab_size
from asyncrl.actor.names import canonical_megatron_name
from asyncrl.models.tiny import make_tiny_checkpoint
from asyncrl.sync.bucketing import iter_buckets


@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("qwen3", False), ("llama", False), ("llama", True)])
def test_hf_megatron_hf_exact(tmp_path, arch, tied):
    hf = make_tiny_checkpoint(tmp_path, arch=arch, num_hidden_layers=2, vocab_size=1000, tie_word_embeddings=tied)
    spec = ModelSpec.from_pretrained(hf)
    sd = load_file(str(hf / "model.safetensors"))
    mg = hf_state_to_megatron(sd, spec, tp=2)
    assert list(mg) == megatron_param_names(spec)
    assert mg["embedding.word_embeddings.weight"].shape[0] == padded_vocab_size(1000, 2) == 1024
    assert mg["embedding.word_embeddings.weight"][1000:].abs().sum() == 0
    qkv = mg["decoder.layers.0.self_attention.linear_qkv.weight"]
    # group 0 = q heads 0,1 then k head 0 then v head 0 (4 heads, 2 kv groups, head_dim 32)
    assert torch.equal(qkv[:64], sd["model.layers.0.self_attn.q_proj.weight"][:64])
    assert torch.equal(qkv[64:96], sd["model.layers.0.self_attn.k_proj.weight"][:32])
    assert torch.equal(qkv[96:128], sd["model.layers.0.self_attn.v_proj.weight"][:32])
    # shard per TP rank and merge back, then to HF: bit-exact
    shards = {k: [tp_shard(k, v, rank=r, tp=2) for r in range(2)] for k, v in mg.items()}
    merged = {k: tp_merge(k, s) for k, s in shards.items()}
    back = dict(megatron_state_to_hf(merged, spec))
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_fc1_shards_gate_and_up_separately(tmp_path):
    hf = make_tiny_checkpoint(tmp_path, num_hidden_layers=1)
    spec = ModelSpec.from_pretrained(hf)
    sd = load_file(str(hf / "model.safetensors"))
    full = hf_state_to_megatron(sd, spec, tp=2)["decoder.layers.0.mlp.linear_fc1.weight"]
    s1 = tp_shard("module.decoder.layers.0.mlp.linear_fc1.weight", full, rank=1, tp=2)
    gate, up = sd["model.layers.0.mlp.gate_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(s1, torch.cat([gate[176:], up[176:]]))
    assert canonical_megatron_name("module.module.decoder.layers.3.mlp.linear_fc1.layer_norm_weight") == (
        "decoder.layers.3.pre_mlp_layernorm.weight"
    )


def test_cli_round_trip(tmp_path):
    hf = make_tiny_checkpoint(tmp_path / "hf", arch="qwen3", num_hidden_layers=2, vocab_size=1000)
    assert main(["hf-to-actor", "--hf", str(hf), "--out", str(tmp_path / "ckpt"), "--tp", "2"]) == 0
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    assert meta["tp"] == 2 and meta["has_optimizer"] is False
    assert main(["actor-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back")]) == 0
    a, b = load_file(str(hf / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "back" / f).read_bytes() == (hf / f).read_bytes()


def test_running_the_mapping_module_points_to_the_cli():
    """``python -m asyncrl.actor.convert --help`` printed nothing and exited 0: the module is the mapping (a library);
    run as a script it names the CLI on stderr and exits non-zero."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    r = subprocess.run(
        [sys.executable, "-m", "asyncrl.actor.convert", "--help"], cwd=root, env=env, capture_output=True, text=True
    )
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout)
    assert "python -m asyncrl.actor.convert_cli hf-to-actor --hf DIR --out CKPT" in r.stderr, r.stderr
    assert "python -m asyncrl.actor.convert_cli --help" in r.stderr


def test_every_converter_option_says_what_it_is():
    (subs,) = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert sorted(subs.choices) == ["actor-to-hf", "hf-to-actor"]
    assert all(c.help for c in subs._choices_actions)  # each command's line in --help
    for name, sub in subs.choices.items():
        options = [a for a in sub._actions if a.option_strings and a.dest != "help"]
        assert options and all(a.help and a.metavar for a in options), name
        assert "must equal actor.tensor_model_parallel_size" in sub.format_help() or name == "actor-to-hf"


def test_spec_rejects_unsupported(tmp_path):
    with pytest.raises(ValueError, match="model_type"):
        ModelSpec.from_hf_config({"model_type": "gpt2"})
    hf = make_tiny_checkpoint(tmp_path, num_hidden_layers=1)
    cfg = json.loads((hf / "config.json").read_text())
    with pytest.raises(ValueError, match="hidden_act"):
        ModelSpec.from_hf_config({**cfg, "hidden_act": "gelu"})
    from asyncrl.actor.model import check_parallel_sizes

    with pytest.raises(ValueError, match="tensor_model_parallel_size=4 must divide num_key_value_heads=2"):
        check_parallel_sizes(ModelSpec.from_hf_config(cfg), tp=4, pp=1)


def test_pipeline_sizes_and_layer_offsets(tmp_path):
    from asyncrl.actor.model import check_parallel_sizes, layer_offset
    from asyncrl.actor.weights import global_layer_name

    cfg = json.loads((make_tiny_checkpoint(tmp_path, num_hidden_layers=4) / "config.json").read_text())
    spec = ModelSpec.from_hf_config({**cfg, "num_hidden_layers": 6})
    check_parallel_sizes(spec, tp=1, pp=3)  # 6 layers over 3 stages
    with pytest.raises(ValueError, match=r"actor.pipeline_model_parallel_size=4 must divide num_hidden_layers=6"):
        check_parallel_sizes(spec, tp=1, pp=4)
    assert [layer_offset(spec, pp=3, pp_rank=r) for r in range(3)] == [0, 2, 4]
    assert global_layer_name("decoder.layers.1.mlp.linear_fc1.weight", 4) == "decoder.layers.5.mlp.linear_fc1.weight"
    assert global_layer_name("decoder.final_layernorm.weight", 4) == "decoder.final_layernorm.weight"


def test_bucketize():
    items = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    buckets = list(iter_buckets(items, 100))  # bytes: 40, 40, 120, 20, 400, 4
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]
    with pytest.raises(ValueError):
        list(iter_buckets(items, 0))
