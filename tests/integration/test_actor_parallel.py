"""The actor under torchrun (2 processes, gloo): TP=2 == TP=1/DP=2 == plain PyTorch, HF parity.

One torchrun launch runs the worker below (this file's ``__main__``): the tiny Qwen2 model
(vocab 1000, padded to 1024 / 256 per TP rank) at TP=1 (DP=2) and then at TP=2 (DP=1), each:
log-probs + entropy of packed variable-length sequences split over several micro-batches, one
training step on synthetic groups (masked tool spans, an equal-reward group), the HF export.
Rank 0 also computes the same things with HF transformers: log-probs/entropy, and the training
step as plain PyTorch (policy_loss on HF log-probs, grad clipping, torch AdamW). Then the same
at TP=2 for a 1-layer Qwen3 (q/k norm, no qkv bias) and a 1-layer Llama with tied embeddings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import proc_helpers  # tests/integration/proc_helpers.py
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
GROUP_SEED = 5


def run_torchrun(script: Path, args: list[str], *, nproc: int = 2, timeout_s: float = 180):
    return proc_helpers.run_torchrun(script, args, nproc=nproc, timeout_s=timeout_s)


def _algo() -> dict:
    return {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "dual_clip": 3.0, "entropy_coef": 0.01}


def _actor_run(hf: str, tp: int, seqs, prompt_lens, groups) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from asyncrl.actor.megatron_actor import Actor
    from asyncrl.actor.synthetic import tiny_actor_config

    cfg = tiny_actor_config(
        hf,
        actor={"tensor_model_parallel_size": tp, "max_tokens_per_microbatch": 48, "adam_eps": 1e-6},
        algorithm=_algo(),
    )
    actor = Actor(cfg)
    from safetensors.torch import load_file

    w0 = load_file(str(Path(hf) / "model.safetensors"))
    export0 = {k: v for b in actor.iter_hf_buckets(1 << 30) for k, v in b}
    exact = sorted(export0) == sorted(w0) and all(torch.equal(export0[k], w0[k]) for k in w0)
    lps = actor.compute_logprobs(seqs, prompt_lens, with_entropy=True)
    metrics = actor.train_step(groups if dist.get_rank() == 0 else None)
    buckets = list(actor.iter_hf_buckets(64 * 1024))
    weights = {k: v for b in buckets for k, v in b}
    ps.destroy_model_parallel()
    return {
        "lps": lps,
        "metrics": metrics,
        "weights": weights,
        "num_buckets": len(buckets),
        "exact": exact,
        "max_bucket": max(sum(t.numel() * t.element_size() for _, t in b) for b in buckets),
    }


def _hf_reference(hf: str, seqs, prompt_lens, groups) -> dict:
    """Log-probs with transformers, and the same training step written as plain PyTorch."""
    from transformers import AutoModelForCausalLM

    from asyncrl.actor.batch import groups_to_samples
    from asyncrl.actor.loss import policy_loss

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)

    def logprobs(seq, p):
        logits = model(torch.tensor([seq])).logits[0, p - 1 : len(seq) - 1].float()
        logz = torch.log_softmax(logits, -1)
        lp = logz.gather(-1, torch.tensor(seq[p:]).unsqueeze(-1)).squeeze(-1)
        ent = -(logz.exp() * logz).sum(-1)
        return lp, ent

    with torch.no_grad():
        lps = [logprobs(s, p) for s, p in zip(seqs, prompt_lens)]
    a = _algo()
    samples = groups_to_samples(groups, normalize_adv_by_std=True, loss_agg_mode="token_mean")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0)
    total = 0.0
    for s in samples:
        lp, ent = logprobs(s.tokens.tolist(), s.prompt_len)
        out = policy_loss(
            lp,
            behav_logp=s.rollout_logprobs.float(),
            prox_logp=None,
            advantages=torch.full_like(lp, s.advantage),
            agg_weight=s.agg_weight.float(),
            mask=s.loss_mask.bool(),
            clip_ratio_low=a["clip_ratio_low"],
            clip_ratio_high=a["clip_ratio_high"],
            dual_clip=a["dual_clip"],
            entropy=ent,
            entropy_coef=a["entropy_coef"],
        )
        out.loss.backward()
        total += out.sums["loss"]
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
    opt.step()
    return {"lps": lps, "loss": total, "grad_norm": grad_norm, "weights": dict(model.state_dict())}


def main() -> None:
    import torch.distributed as dist

    from asyncrl.actor.synthetic import synthetic_groups

    hf, out, others = sys.argv[1], sys.argv[2], sys.argv[3:]
    dist.init_process_group("gloo")
    vocab = json.loads((Path(hf) / "config.json").read_text())["vocab_size"]
    groups = synthetic_groups(seed=GROUP_SEED, num_groups=4, group_size=4, vocab_size=vocab)
    seqs = [t.prompt_ids + t.response_ids for g in groups[:2] for t in g.trajectories]
    prompt_lens = [len(t.prompt_ids) for g in groups[:2] for t in g.trajectories]
    r1 = _actor_run(hf, 1, seqs, prompt_lens, groups)
    r2 = _actor_run(hf, 2, seqs, prompt_lens, groups)
    if dist.get_rank() == 0:
        ref = _hf_reference(hf, seqs, prompt_lens, groups)
        from safetensors.torch import load_file

        w0 = load_file(str(Path(hf) / "model.safetensors"))

        maxdiff = proc_helpers.scaled_maxdiff

        res = {
            "lp_tp1_tp2": maxdiff([x[0] for x in r1["lps"]], [x[0] for x in r2["lps"]]),
            "ent_tp1_tp2": maxdiff([x[1] for x in r1["lps"]], [x[1] for x in r2["lps"]]),
            "lp_tp2_hf": maxdiff([x[0] for x in r2["lps"]], [x[0] for x in ref["lps"]]),
            "ent_tp2_hf": maxdiff([x[1] for x in r2["lps"]], [x[1] for x in ref["lps"]]),
            "lp_mean": sum(x[0].mean().item() for x in ref["lps"]) / len(ref["lps"]),
            "metrics_tp1": r1["metrics"],
            "metrics_tp2": r2["metrics"],
            "ref_loss": ref["loss"],
            "ref_grad_norm": ref["grad_norm"],
            "w_tp1_tp2": max((r1["weights"][k] - r2["weights"][k]).abs().max().item() for k in w0),
            "w_tp2_ref": max((r2["weights"][k] - ref["weights"][k]).abs().max().item() for k in w0),
            "w_moved": max((r2["weights"][k] - w0[k]).abs().max().item() for k in w0),
            "names_equal": sorted(r1["weights"]) == sorted(r2["weights"]) == sorted(w0),
            "hf_roundtrip_exact": r1["exact"] and r2["exact"],
            "num_buckets": r2["num_buckets"],
            "max_bucket": r2["max_bucket"],
        }
    # the other families (Qwen3 q/k norm, Llama, tied embeddings): HF -> actor at TP=2 -> HF exact,
    # log-probs equal to transformers'
    for other in others:
        r = _actor_run(other, 2, seqs, prompt_lens, groups)
        if dist.get_rank() == 0:
            from safetensors.torch import load_file

            ref = _hf_reference(other, seqs, prompt_lens, groups)
            w0 = load_file(str(Path(other) / "model.safetensors"))
            res[f"{other}/lp_hf"] = proc_helpers.scaled_maxdiff([x[0] for x in r["lps"]], [y[0] for y in ref["lps"]])
            res[f"{other}/w_tp2_ref"] = max((r["weights"][k] - ref["weights"][k]).abs().max().item() for k in w0)
            res[f"{other}/w_worst"] = max(w0, key=lambda k: (r["weights"][k] - ref["weights"][k]).abs().max().item())
            res[f"{other}/names_equal"] = sorted(r["weights"]) == sorted(w0) and r["exact"]
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(res, indent=1))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_actor_tp2_dp2_and_plain_pytorch(tmp_path):
    pytest.importorskip("transformers")
    from asyncrl.models.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf", num_hidden_layers=2, vocab_size=1000)
    others = [
        make_tiny_checkpoint(tmp_path / "qwen3", arch="qwen3", num_hidden_layers=1, seed=1),
        make_tiny_checkpoint(
            tmp_path / "llama", arch="llama", num_hidden_layers=1, seed=2, tie_word_embeddings=True, vocab_size=1000
        ),
    ]
    out = tmp_path / "out.json"
    proc = run_torchrun(Path(__file__), [str(hf), str(out), *map(str, others)])
    assert proc.returncode == 0, proc.stderr[-5000:]
    r = json.loads(out.read_text())
    # log-probs: TP=2 == TP=1 == transformers within 1e-5 of their scale (also the entropy; see proc_helpers)
    tol = proc_helpers.SCALED_REL
    assert r["lp_tp1_tp2"] < tol and r["ent_tp1_tp2"] < tol
    assert r["lp_tp2_hf"] < tol and r["ent_tp2_hf"] < tol
    assert r["lp_mean"] < -3.0  # real log-probs of a random model over ~1000 tokens
    m1, m2 = r["metrics_tp1"], r["metrics_tp2"]
    for k in (
        "train/loss",
        "train/grad_norm",
        "train/entropy",
        "train/clip_fraction",
        "train/logprob_mismatch",
        "train/num_tokens",
    ):
        rel = proc_helpers.GRAD_NORM_REL if k == "train/grad_norm" else 1e-5
        assert abs(m1[k] - m2[k]) <= rel * max(1.0, abs(m1[k])), (k, m1[k], m2[k])
    assert m1["train/num_microbatches"] >= 2  # the token budget split the batch
    assert m2["train/clip_fraction"] > 0  # random behaviour log-probs: clipping is exercised
    assert abs(m2["train/loss"] - r["ref_loss"]) < 1e-5
    assert abs(m2["train/grad_norm"] - r["ref_grad_norm"]) < proc_helpers.GRAD_NORM_REL * r["ref_grad_norm"]
    assert m2["train/lr"] == pytest.approx(1e-3) and m2["train/step_skipped"] == 0.0
    # one Adam step: same weights everywhere (Adam's first step is ~lr*sign(g): compare to lr)
    assert r["w_moved"] > 5e-4
    w_tol = proc_helpers.ADAM_STEP_REL * 1e-3  # lr/20
    assert r["w_tp1_tp2"] < w_tol
    assert r["w_tp2_ref"] < w_tol
    assert r["names_equal"] and r["hf_roundtrip_exact"]  # HF -> actor (TP=1 and TP=2) -> HF is bit-exact
    assert r["num_buckets"] > 5 and r["max_bucket"] <= 1000 * 128 * 4  # a single tensor may exceed a bucket
    for other in others:
        assert r[f"{other}/lp_hf"] < tol and r[f"{other}/names_equal"]
        # also the training step vs plain PyTorch
        assert r[f"{other}/w_tp2_ref"] < w_tol, (other, r[f"{other}/w_worst"])


if __name__ == "__main__":
    main()
