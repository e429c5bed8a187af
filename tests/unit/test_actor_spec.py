"""The attention choice, the model inputs of a packed batch, recompute settings and FusedCoreAttention
itself (plain torch, no process group)."""

from types import SimpleNamespace

import pytest
import torch

from asyncrl.actor.batch import pack, pad_rows
from asyncrl.actor.layer_spec import (
    FusedCoreAttention,
    attention_path,
    model_inputs,
    p2p_shape,
    recompute_settings,
    resolve_attention,
)


def test_resolve_attention():
    assert resolve_attention("auto", cuda=True, te_available=True) == "te"
    assert resolve_attention("auto", cuda=True, te_available=False) == "sdpa"
    assert resolve_attention("auto", cuda=False, te_available=True) == "sdpa"
    assert resolve_attention("unfused", cuda=False, te_available=False) == "unfused"
    with pytest.raises(ValueError, match="actor.attention_backend"):
        resolve_attention("te", cuda=False, te_available=True)
    with pytest.raises(ValueError, match="actor.attention_backend"):
        resolve_attention("flash", cuda=True, te_available=True)
    assert attention_path("sdpa", dtype=torch.float32, device="cpu") == "sdpa-flash-cpu"
    assert attention_path("te", dtype=torch.bfloat16, device="cpu") == "te"


def test_recompute_settings_map_to_megatron_names():
    assert recompute_settings("none", None, None, layers_per_stage=4) == {}
    assert recompute_settings("selective", None, None, layers_per_stage=4) == {"recompute_granularity": "selective"}
    assert recompute_settings("full", None, None, layers_per_stage=4) == {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    }
    assert recompute_settings("full", "block", 4, layers_per_stage=4)["recompute_method"] == "block"
    with pytest.raises(ValueError, match="actor.recompute_num_layers"):
        recompute_settings("full", "uniform", 5, layers_per_stage=4)


def test_segments_and_thd_inputs_of_a_packed_batch():
    p = pad_rows(pack([[1, 2, 3, 4], [5, 6, 7], [8]], [2, 1, 1], row_len=5), 3)
    # first fit, longest first: row 0: seq0 (4) + seq2 (1); row 1: seq1 (3) + padding (2); row 2: padding (5)
    assert p.cu_seqlens.tolist() == [0, 4, 5, 8, 10, 15] and p.max_seqlen == 5
    m = p.attention_mask[:, 0]
    assert m.shape == (3, 5, 5) and m[0, 4, 3] and not m[0, 4, 4] and not m[1, 2, 0] and m[1, 3, 2]
    assert not m[1, 4, 3] and not m[2, 4, 0] and m[2, 0, 1]
    args, kw = model_inputs(p, "sdpa")
    assert args[0].shape == (1, 15) and args[2] is None
    ps = kw["packed_seq_params"]
    assert ps.qkv_format == "thd" and ps.cu_seqlens_q.dtype == torch.int32 and ps.max_seqlen_q == 5
    assert torch.equal(args[0].reshape(3, 5), p.input_ids)  # same flat order: pred_index holds
    pad = torch.tensor([[0, 0, 0, 0, 0], [0, 0, 0, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(kw["padding_mask"], pad.reshape(1, 15))  # megatron-core's (MoE routing), as input_ids
    args, kw = model_inputs(p, "unfused")
    assert args[0].shape == (3, 5) and args[2].shape == (3, 1, 5, 5) and torch.equal(kw.pop("padding_mask"), pad)
    assert kw == {} and "padding_mask" not in model_inputs(pack([[1, 2], [3, 4]], [1, 1]), "unfused")[1]
    assert p2p_shape(3, 5, "sdpa") == (15, 1) and p2p_shape(3, 5, "unfused") == (5, 3)


def _reference(q, k, v, mask, scale):
    """Plain softmax attention: q [s, b, h, d], k/v [s, b, g, d], mask [b, 1, s, s] True = masked."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    out = torch.einsum("bhst,tbhd->sbhd", probs, v)
    return out.reshape(q.shape[0], q.shape[1], -1)


def test_fused_core_attention_thd_and_sbhd_match_plain_softmax():
    from megatron.core.packed_seq_params import PackedSeqParams

    cfg = SimpleNamespace(
        context_parallel_size=1,
        softmax_type="vanilla",
        kv_channels=8,
        apply_query_key_layer_scaling=False,
        attention_dropout=0.0,
    )
    attn = FusedCoreAttention(cfg, 1, None, "self")
    g = torch.Generator().manual_seed(0)
    p = pad_rows(pack([[1] * 6, [2] * 3, [3] * 2], [1, 1, 1], row_len=7), 2)
    R, C = p.input_ids.shape
    q = torch.randn(C, R, 4, 8, generator=g)
    k, v = torch.randn(C, R, 2, 8, generator=g), torch.randn(C, R, 2, 8, generator=g)
    ref = _reference(q, k, v, p.attention_mask, 8**-0.5)  # [C, R, 32]

    out = attn(q, k, v, p.attention_mask)  # sbhd with the dense mask
    assert torch.allclose(out, ref, atol=1e-5)
    flat = [x.transpose(0, 1).reshape(R * C, x.shape[2], 8) for x in (q, k, v)]  # thd: rows one after another
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=p.cu_seqlens,
        cu_seqlens_kv=p.cu_seqlens,
        max_seqlen_q=p.max_seqlen,
        max_seqlen_kv=p.max_seqlen,
    )
    out = attn(*flat, None, packed_seq_params=params)  # [R*C, 32]
    assert torch.allclose(out, ref.transpose(0, 1).reshape(R * C, -1), atol=1e-5)
    causal = torch.triu(torch.ones(C, C, dtype=torch.bool), 1).expand(R, 1, C, C)
    assert torch.allclose(attn(q, k, v, None), _reference(q, k, v, causal, 8**-0.5), atol=1e-5)


def test_thd_attention_on_cpu_runs_the_flash_kernel_and_its_gradients_match_plain_softmax():
    """The per-segment SDPA calls take 4-D inputs so that torch's CPU flash kernel runs (3-D ones fall back to
    the math kernel, ~1.5x slower with its backward); outputs and gradients still match plain softmax attention."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cfg = SimpleNamespace(
        context_parallel_size=1,
        softmax_type="vanilla",
        kv_channels=8,
        apply_query_key_layer_scaling=False,
        attention_dropout=0.0,
    )
    attn = FusedCoreAttention(cfg, 1, None, "self")
    g = torch.Generator().manual_seed(1)
    p = pad_rows(pack([[1] * 9, [2] * 4, [3] * 5, [4] * 2], [1, 1, 1, 1], row_len=12), 2)
    R, C = p.input_ids.shape
    q = torch.randn(C, R, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(C, R, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(C, R, 2, 8, generator=g, requires_grad=True)
    ref = _reference(q, k, v, p.attention_mask, 8**-0.5).transpose(0, 1).reshape(R * C, -1)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=p.cu_seqlens,
        cu_seqlens_kv=p.cu_seqlens,
        max_seqlen_q=p.max_seqlen,
        max_seqlen_kv=p.max_seqlen,
    )
    flat = [x.transpose(0, 1).reshape(R * C, x.shape[2], 8) for x in (q, k, v)]
    with torch.profiler.profile() as prof:
        out = attn(*flat, None, packed_seq_params=params)
    kernels = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in kernels, sorted(kernels)
    assert "aten::_scaled_dot_product_attention_math" not in kernels
    assert torch.allclose(out, ref, atol=1e-5)
    w = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5)
