"""Fused attention (asyncrl.actor.layer_spec) against Megatron's unfused local attention, on CPU.

The pytest test launches this file under ``torchrun --nproc_per_node 1`` (gloo). The worker builds
the tiny model twice from the same HF weights, once with the ``unfused`` spec (Megatron's
``DotProductAttention``: dense block-diagonal mask, the S x S probabilities) and once with the
``sdpa`` spec (thd layout, per-segment causal SDPA, no mask), for a Qwen2 (GQA, qkv bias) and a
Qwen3 (q/k norm, head_dim != hidden/heads) model, and compares on packed micro-batches (several
sequences per row, padding runs, padding rows): the log-probs of the response tokens and the
gradients of their sum. The fused model is also run with full activation recompute (same
log-probs and gradients) and with a dense mask in the sbhd layout. Last, the bytes autograd keeps
for backward are compared with ``asyncrl.actor.memory``'s estimate. Then three ``Actor``s (unfused,
sdpa, sdpa with ``actor.recompute_granularity = "full"``) take two train steps on one batch: same
loss and gradient norm.
"""

import json
import sys
from pathlib import Path

import proc_helpers  # tests/integration/proc_helpers.py
import pytest
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-4


def _batches(vocab: int):
    from asyncrl.actor.batch import pack, pack_uniform

    gen = torch.Generator().manual_seed(3)

    def seq(n):
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    a = pack([seq(n) for n in (37, 20, 12, 9, 30)], [5, 3, 4, 2, 6])  # rows of 37: docs + padding runs
    b = pack_uniform([([seq(n) for n in (8, 25)], [2, 7])], rows=3, row_len=40)[0]  # whole padding row
    return [a, b]


def _logprobs_and_grads(model, packed, backend, vocab):
    from asyncrl.actor.layer_spec import response_logits
    from asyncrl.actor.logprobs import logprobs_from_logits

    model.zero_grad(set_to_none=True)
    logits = response_logits(model, packed, backend)
    logp, _ = logprobs_from_logits(logits, packed, vocab_start=0, true_vocab=vocab, with_entropy=False)
    logp.sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logp.detach(), grads


def saved_bytes(model, packed, backend, vocab) -> tuple[int, int]:
    """Bytes autograd keeps for backward (parameters excluded): the model's forward, then the log-probs."""
    from asyncrl.actor.layer_spec import response_logits
    from asyncrl.actor.logprobs import logprobs_from_logits

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def keep(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logits = response_logits(model, packed, backend)
        in_model = sum(seen.values())
        seen.clear()
        logprobs_from_logits(logits, packed, vocab_start=0, true_vocab=vocab, with_entropy=True)
    return in_model, sum(seen.values())


def memory_check(model, spec, hf_dir: str) -> dict:
    """The estimate of asyncrl.actor.memory against what the fused model really keeps (fp32, CPU).

    Short sequences, so the S x S probabilities CPU's math SDPA keeps are negligible (flash keeps none)."""
    from asyncrl.actor.batch import pack
    from asyncrl.actor.memory import ModelShape, estimate_actor_memory
    from asyncrl.models.spec import load_hf_config

    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, spec.vocab_size, (32,), generator=gen).tolist() for _ in range(16)]
    packed = pack(seqs, [1] * 16, row_len=128)
    act, lp = saved_bytes(model, packed, "sdpa", spec.vocab_size)
    est = estimate_actor_memory(
        ModelShape.from_hf_config(load_hf_config(hf_dir)),
        tp=1,
        pp=1,
        dp=1,
        bf16=False,
        microbatch_tokens=packed.num_tokens,
        row_len=128,
    )
    return {
        "act_measured": act,
        "act_estimated": est.activations,
        "logits_measured": lp,
        "logits_estimated": est.logits,
    }


def compare(hf_dir: str) -> dict:
    from asyncrl.actor.layer_spec import recompute_settings
    from asyncrl.actor.model import ModelSpec, build_gpt_model
    from asyncrl.actor.weights import load_hf_into_model

    spec = ModelSpec.from_pretrained(hf_dir)

    def build(backend, recompute=None):
        torch.manual_seed(0)
        m = build_gpt_model(spec, tp=1, attention_backend=backend, recompute=recompute)
        load_hf_into_model(m, hf_dir, spec, tp_rank=0, tp=1)
        return m

    ref, fused = build("unfused"), build("sdpa")
    full = build("sdpa", recompute_settings("full", None, None, layers_per_stage=spec.num_layers))
    assert full.config.recompute_granularity == "full" and full.training
    out = {
        "logp_diff": 0.0,
        "grad_rel_diff": 0.0,
        "recompute_logp_diff": 0.0,
        "recompute_grad_diff": 0.0,
        "sbhd_mask_logp_diff": 0.0,
        "num_tokens": 0,
    }
    for packed in _batches(spec.vocab_size):
        lp_ref, g_ref = _logprobs_and_grads(ref, packed, "unfused", spec.vocab_size)
        lp_f, g_f = _logprobs_and_grads(fused, packed, "sdpa", spec.vocab_size)
        lp_r, g_r = _logprobs_and_grads(full, packed, "sdpa", spec.vocab_size)
        lp_m, _ = _logprobs_and_grads(fused, packed, "unfused", spec.vocab_size)  # dense mask, sbhd
        out["num_tokens"] += int(lp_ref.numel())
        out["logp_diff"] = max(out["logp_diff"], (lp_ref - lp_f).abs().max().item())
        out["sbhd_mask_logp_diff"] = max(out["sbhd_mask_logp_diff"], (lp_ref - lp_m).abs().max().item())
        out["recompute_logp_diff"] = max(out["recompute_logp_diff"], (lp_f - lp_r).abs().max().item())
        for n in g_ref:
            scale = g_ref[n].abs().max().item() + 1e-6
            out["grad_rel_diff"] = max(out["grad_rel_diff"], (g_ref[n] - g_f[n]).abs().max().item() / scale)
            out["recompute_grad_diff"] = max(out["recompute_grad_diff"], (g_f[n] - g_r[n]).abs().max().item() / scale)
    out.update(memory_check(fused, spec, hf_dir))
    return out


def actor_steps(hf_dir: str) -> dict:
    """Two Actor train steps per setting (attention backend, recompute) on the same batch: the metrics."""
    from megatron.core import parallel_state as ps

    from asyncrl.actor.megatron_actor import Actor
    from asyncrl.actor.synthetic import synthetic_groups, tiny_actor_config

    groups = synthetic_groups(seed=4, num_groups=4, group_size=4, vocab_size=500, response_len=(10, 40))
    out = {}
    for name, actor in (
        ("unfused", {"attention_backend": "unfused"}),
        ("sdpa", {"attention_backend": "sdpa"}),
        (
            "sdpa_full_recompute",
            {"attention_backend": "sdpa", "recompute_granularity": "full", "recompute_num_layers": 2},
        ),
    ):
        a = Actor(tiny_actor_config(hf_dir, actor={**actor, "max_tokens_per_microbatch": 256}))
        ms = [a.train_step(groups) for _ in range(2)]
        out[name] = {
            "attention": a.attention,
            "recompute": a.ddp.module.config.recompute_granularity,
            "loss": [m["train/loss"] for m in ms],
            "grad_norm": [m["train/grad_norm"] for m in ms],
        }
        ps.destroy_model_parallel()
    return out


def main() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from asyncrl.cluster.megatron_cpu import apply_cpu_shims

    dist.init_process_group("gloo")
    apply_cpu_shims()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    results = {Path(d).name: compare(d) for d in sys.argv[2:]}
    ps.destroy_model_parallel()
    results["actor"] = actor_steps(sys.argv[2])
    Path(sys.argv[1]).write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.mark.slow
def test_fused_attention_matches_unfused_logprobs_and_grads(tmp_path):
    from asyncrl.models.tiny import make_tiny_checkpoint

    dirs = [
        str(make_tiny_checkpoint(tmp_path / arch, arch=arch, seed=1, num_hidden_layers=2))
        for arch in ("qwen2", "qwen3")
    ]
    out = tmp_path / "out.json"
    res = proc_helpers.run_torchrun(Path(__file__), [str(out), *dirs], nproc=1, timeout_s=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = json.loads(out.read_text())
    steps = results.pop("actor")
    assert steps["sdpa"]["attention"] == "sdpa" and steps["unfused"]["attention"] == "unfused"
    assert steps["sdpa_full_recompute"]["recompute"] == "full" and steps["sdpa"]["recompute"] is None
    for name in ("sdpa", "sdpa_full_recompute"):  # the Actor's steps: same loss and grad norm, step after step
        for key in ("loss", "grad_norm"):
            for got, ref in zip(steps[name][key], steps["unfused"][key]):
                assert abs(got - ref) <= TOL * max(1.0, abs(ref)), (name, key, steps)
    for arch, r in results.items():
        assert r["num_tokens"] > 50, (arch, r)
        assert r["logp_diff"] < TOL, (arch, r)
        assert r["sbhd_mask_logp_diff"] < TOL, (arch, r)
        assert r["grad_rel_diff"] < TOL, (arch, r)
        assert r["recompute_logp_diff"] < 1e-6 and r["recompute_grad_diff"] < 1e-6, (arch, r)
        # the memory estimate tracks what megatron-core keeps for backward (an upper bound for the logits)
        assert 0.85 < r["act_estimated"] / r["act_measured"] < 1.2, (arch, r)
        # autograd keeps 2 fp32 [T, V] tensors; the estimate is the forward peak (logits, their picked rows,
        # 4 fp32 tensors): an upper bound of what is kept, by about 6 / 2
        assert 2.5 < r["logits_estimated"] / r["logits_measured"] < 3.3, (arch, r)


if __name__ == "__main__":
    main()
