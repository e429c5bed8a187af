"""The served-weights check's pure core: which parameters are read back, and what counts as equal."""

from __future__ import annotations

import torch

from asyncrl.sync.verify import MAX_PROBES, PROBE_ROWS, SentRows, probe_names, same_values


def test_probes_are_the_unlayered_and_the_first_and_last_layers():
    names = ["model.embed_tokens.weight"]
    for i in range(4):
        names += [f"model.layers.{i}.self_attn.q_proj.weight", f"model.layers.{i}.mlp.down_proj.weight"]
    names += ["model.norm.weight", "lm_head.weight"]
    got = probe_names(names)
    assert got == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.mlp.down_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]


def test_probes_are_capped_with_a_spread():
    names = [f"model.layers.0.mlp.experts.{e}.up_proj.weight" for e in range(500)]
    got = probe_names(names)
    assert len(got) == MAX_PROBES and got[0] == names[0] and got[-1] != names[MAX_PROBES - 1]


def test_same_values_exact_or_rounded_to_the_engines_dtype():
    sent = torch.tensor([[0.1, 0.2, 0.3], [1.0, -2.5, 3.25]])
    assert same_values(sent, sent.tolist())
    assert same_values(sent, sent.to(torch.bfloat16).float().tolist())
    assert same_values(sent, sent.half().float().tolist())
    stale = sent.clone()
    stale[1, 2] += 1e-3
    assert not same_values(sent, stale.tolist())
    assert not same_values(sent, sent[:1].tolist()), "a shape difference is a difference"
    assert not same_values(sent, "not a list")


def test_sent_rows_capture_the_first_rows_and_pass_buckets_through():
    sent = SentRows()
    w = torch.arange(12.0).reshape(4, 3)
    buckets = [[("a", w), ("b", torch.ones(5, dtype=torch.bfloat16))]]
    assert list(sent.capture(buckets)) == buckets
    assert torch.equal(sent.rows["a"], w[:PROBE_ROWS]) and sent.rows["b"].dtype == torch.float32
