"""The CPU engine's Qwen3-MoE equals transformers' Qwen3MoeForCausalLM, and takes weights under the HF names.

Log-probs of every position, from one prefill and from a mixed batch (decode rows beside a prefill, through the KV
pool), against transformers on the same tokens: all layers sparse with renormalised top-k (the tiny default), a
dense layer beside a sparse one (``mlp_only_layers``), and unnormalised top-k (``norm_topk_prob`` false)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncrl.cpu_engine.kv_pool import KVPool
from asyncrl.cpu_engine.model import CausalLM, iter_safetensors, load_model, read_checkpoint
from asyncrl.models.routing import route
from asyncrl.models.tiny import make_tiny_checkpoint

transformers = pytest.importorskip("transformers")

LOGPROB_ATOL = 1e-4
"""As the dense decoder's parity with transformers (tests/unit/test_torch_decoder.py): fp32 on both sides."""

CASES = {
    "all sparse, renormalised": {},
    "dense layer 1": {"num_hidden_layers": 2, "mlp_only_layers": [1]},
    "unnormalised top-k": {"norm_topk_prob": False},
}


def _reference_logprobs(path, ids: list[int]) -> torch.Tensor:
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert type(ref).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        return torch.log_softmax(ref(input_ids=torch.tensor([ids])).logits[0], dim=-1)


def _prefill_logprobs(m: CausalLM, ids: list[int]) -> torch.Tensor:
    h = m.forward(torch.tensor(ids), torch.tensor([0]), torch.tensor([len(ids)]), KVPool(m.spec, 1), row0=0)
    return torch.log_softmax(m.logits(h), dim=-1)


@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_equal_transformers(tmp_path, case):
    path = make_tiny_checkpoint(tmp_path / "m", arch="qwen3_moe", seed=4, **CASES[case])
    m = load_model(path)
    spec = m.spec
    if case == "dense layer 1":
        assert spec.moe_layers == (0,) and "model.layers.1.mlp.gate_proj.weight" in m.params
        assert not any(n.startswith("model.layers.1.mlp.experts.") for n in m.params)
    torch.manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (23,)).tolist()
    want = _reference_logprobs(path, ids)
    got = _prefill_logprobs(m, ids)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=0)
    # the test sees a routing mistake: the experts' weights unnormalised where they are renormalised (or back)
    flipped = CausalLM(dataclasses.replace(spec, norm_topk_prob=not spec.norm_topk_prob))
    flipped.load_weights(iter_safetensors(path))
    assert (_prefill_logprobs(flipped, ids) - want).abs().max() > 100 * LOGPROB_ATOL


def test_mixed_batch_through_the_kv_pool_equals_transformers(tmp_path):
    """Two requests decoding one token each beside a third's prefill, in one packed forward: the experts see the
    tokens of all three at once; each row's log-probs are transformers' on that row's whole sequence."""
    path = make_tiny_checkpoint(tmp_path / "m", arch="qwen3_moe", seed=5, num_hidden_layers=2)
    m = load_model(path)
    torch.manual_seed(1)
    seqs = [torch.randint(0, m.spec.vocab_size, (n,)).tolist() for n in (9, 6, 11)]
    kv = KVPool(m.spec, max_rows=3)
    # rows 0 and 1 hold all but their last token; row 2 is new
    past = [len(seqs[0]) - 1, len(seqs[1]) - 1]
    for row in (0, 1):
        ids = seqs[row][:-1]
        m.forward(torch.tensor(ids), torch.tensor([0]), torch.tensor([len(ids)]), kv, row0=row)
    feed = [seqs[0][-1], seqs[1][-1], *seqs[2]]
    h = m.forward(torch.tensor(feed), torch.tensor([*past, 0]), torch.tensor([1, 1, len(seqs[2])]), kv, row0=0)
    got = torch.log_softmax(m.logits(h), dim=-1)
    want = [_reference_logprobs(path, s) for s in seqs]
    torch.testing.assert_close(got[0], want[0][-1], atol=LOGPROB_ATOL, rtol=0)
    torch.testing.assert_close(got[1], want[1][-1], atol=LOGPROB_ATOL, rtol=0)
    torch.testing.assert_close(got[2:], want[2], atol=LOGPROB_ATOL, rtol=0)


def test_route_is_softmax_top_k_renormalised_or_not():
    torch.manual_seed(2)
    hdn, w = torch.randn(5, 16), torch.randn(8, 16)
    probs = torch.softmax(hdn @ w.T, dim=-1)
    weights, experts = route(hdn, w, 3, renormalize=False)
    assert torch.equal(experts, probs.argsort(dim=-1, descending=True)[:, :3])
    torch.testing.assert_close(weights, probs.gather(1, experts))
    renormed, same = route(hdn, w, 3, renormalize=True)
    assert torch.equal(same, experts)
    torch.testing.assert_close(renormed, weights / weights.sum(dim=-1, keepdim=True))


def test_weights_under_hf_names_land_in_the_experts_and_unknown_names_are_refused(tmp_path):
    a = make_tiny_checkpoint(tmp_path / "a", arch="qwen3_moe", seed=0, num_hidden_layers=2, mlp_only_layers=[1])
    b = make_tiny_checkpoint(tmp_path / "b", arch="qwen3_moe", seed=1, num_hidden_layers=2, mlp_only_layers=[1])
    m, wb = load_model(a), dict(iter_safetensors(b))
    assert set(m.params) == set(wb)  # every HF name of the checkpoint, and no other
    expert = "model.layers.0.mlp.experts.5.up_proj.weight"
    m.load_weights([(expert, wb[expert]), ("model.layers.0.mlp.gate.weight", wb["model.layers.0.mlp.gate.weight"])])
    f = m.spec.moe_ffn_hidden_size
    assert torch.equal(m.layers[0]["experts_gu"][5, f:], wb[expert])
    assert torch.equal(m.layers[0]["router_w"], wb["model.layers.0.mlp.gate.weight"])
    # a whole checkpoint from disk: the same names checked, then loaded; served log-probs become b's
    m.load_weights(read_checkpoint(m, b))
    ids = list(range(3, 20))
    torch.testing.assert_close(_prefill_logprobs(m, ids), _prefill_logprobs(load_model(b), ids), atol=0, rtol=0)
    for bad in ("model.layers.0.mlp.experts.8.up_proj.weight", "model.layers.1.mlp.gate.weight"):
        with pytest.raises(KeyError, match="unknown parameter"):
            m.load_weights([(bad, torch.zeros(1))])


def test_standby_bank_swaps_the_expert_buffers(tmp_path):
    """The weight receive's swap (``swap_groups``) exchanges a layer's experts as whole buffers, views included."""
    path = make_tiny_checkpoint(tmp_path / "m", arch="qwen3_moe", seed=0, num_hidden_layers=1)
    m, bank = load_model(path), CausalLM(load_model(path).spec)
    groups = ["layers.0.router_w", "layers.0.experts_gu", "layers.0.experts_down"]
    assert set(m.groups["layers.0.experts_down"]) == {
        f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(8)
    }
    old = m.params["model.layers.0.mlp.experts.3.down_proj.weight"].clone()
    m.swap_groups(bank, groups)
    assert not m.params["model.layers.0.mlp.experts.3.down_proj.weight"].any() and not m.layers[0]["router_w"].any()
    assert torch.equal(bank.params["model.layers.0.mlp.experts.3.down_proj.weight"], old)
    assert (
        bank.params["model.layers.0.mlp.experts.3.down_proj.weight"].data_ptr()
        == bank.layers[0]["experts_down"][3].data_ptr()
    )


def _reference_routing(path, ids: list[int], k: int) -> torch.Tensor:
    """transformers' experts of every token in every sparse layer: [T, sparse layers, k] (its router logits' top-k;
    softmax and renormalisation keep the order)."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor([ids]), output_router_logits=True).router_logits
    return torch.stack([lg.topk(k, dim=-1).indices for lg in logits], dim=1)


@pytest.mark.parametrize("case", ["all sparse, renormalised", "dense layer 1"])
def test_a_routing_pool_records_every_tokens_experts_as_transformers_routes_them(tmp_path, case):
    """Two requests, each prefilled, then fed more beside each other (a mixed batch: one decodes a token, the other
    continues with two): the pool's routing of every position is transformers' top-k of its router logits; -1 in a
    dense layer. Capturing changes no output (``last_only`` included), and the routing travels with the row
    (``read_row`` / ``write_row``: the prefix cache's copies)."""
    path = make_tiny_checkpoint(tmp_path / "m", arch="qwen3_moe", seed=6, **CASES[case])
    m = load_model(path)
    spec = m.spec
    torch.manual_seed(3)
    seqs = [torch.randint(0, spec.vocab_size, (n,)).tolist() for n in (7, 10)]  # rows 0 and 1
    fed = [len(seqs[0]) - 1, len(seqs[1]) - 2]
    outs = []
    kv, plain = KVPool(spec, 2, routing=True), KVPool(spec, 2)
    for pool in (kv, plain):
        prefills = [
            m.forward(torch.tensor(s[:n]), torch.tensor([0]), torch.tensor([n]), pool, row0=row)
            for row, (s, n) in enumerate(zip(seqs, fed))
        ]
        feed = torch.tensor(seqs[0][fed[0] :] + seqs[1][fed[1] :])
        h = m.forward(feed, torch.tensor(fed), torch.tensor([1, 2]), pool, row0=0, last_only=True)
        outs.append((*prefills, h))
    assert outs[0][-1].shape == (2, spec.hidden_size)
    # the prefills the same; the last tokens through another attention path (all tokens' instead of theirs alone)
    torch.testing.assert_close(outs[0][:2], outs[1][:2], atol=0, rtol=0)
    torch.testing.assert_close(outs[0][2], outs[1][2])
    assert plain.routed is None and kv.routed.dtype == torch.int32
    dense = [i for i in range(spec.num_layers) if not spec.is_moe_layer(i)]
    for row, s in enumerate(seqs):
        got = kv.routed[row, : len(s)]
        want = _reference_routing(path, s, spec.num_experts_per_tok)
        assert torch.equal(got[:, list(spec.moe_layers)], want.to(torch.int32))
        assert (got[:, dense] == -1).all() and (kv.routed[row, len(s) :] == -1).all()
    other = KVPool(spec, 1, routing=True)
    other.write_row(0, kv.read_row(1, len(seqs[1])), len(seqs[1]))
    assert torch.equal(other.routed[0], kv.routed[1])


def test_routing_capture_needs_experts(tmp_path):
    spec = load_model(make_tiny_checkpoint(tmp_path / "d", arch="qwen3", num_hidden_layers=1)).spec
    with pytest.raises(ValueError, match="model_type='qwen3' has no experts.*--enable-return-routed-experts"):
        KVPool(spec, 1, routing=True)
