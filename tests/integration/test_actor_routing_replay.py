"""Routing replay in the actor (``actor.moe_routing_replay``) under torchrun (2 processes, gloo).

The tiny Qwen3-MoE (4 sparse layers, 8 experts, top-2, renormalised top-k) and a mixed one (layer 1 dense,
top-k probabilities not renormalised): every position of every sequence is given experts chosen at random
(distinct per layer; -1 in a dense layer and at each sequence's last position, as the engine answers). The
actor's log-probs with those experts replayed equal transformers' ``Qwen3MoeForCausalLM`` whose routers are made
to pick the same experts (their probabilities from its own router, renormalised as the model says), and differ
from the actor's own routing (which equals transformers' unforced). Both token orders of the router are covered:
fused attention (one row per micro-batch, EP=2) and unfused (rows of the longest sequence, EP=1); at PP=2 each
stage's routers replay their own layers (rows padded to the pipeline's one shape). A training
step on groups whose trajectories carry the experts (their rollout log-probs the replayed ones) runs with them
replayed (DP=2: each rank's share arrives with its rows): its log-prob mismatch is nil, and it moves the weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import proc_helpers  # tests/integration/proc_helpers.py
import pytest
import torch


def _forced(seqs, spec_cfg: dict, seed: int) -> list[torch.Tensor]:
    """Random distinct experts per (position, MoE layer), -1 in dense layers and at each last position:
    ``[len, layers * top-k]`` int32."""
    layers, k, e = spec_cfg["num_hidden_layers"], spec_cfg["num_experts_per_tok"], spec_cfg["num_experts"]
    dense = set(spec_cfg.get("mlp_only_layers") or ())
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in seqs:
        r = torch.rand(len(s), layers, e, generator=gen).argsort(-1)[..., :k].to(torch.int32)
        for i in dense:
            r[:, i] = -1
        r[-1] = -1
        out.append(r.reshape(len(s), layers * k))
    return out


def _hf_logprobs(hf: str, seqs, prompt_lens, forced=None) -> list[torch.Tensor]:
    """transformers' log-probs; with ``forced``, each sparse layer's router picks those experts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    cfg = model.config
    pick: dict[str, torch.Tensor] = {}

    def hook(layer: int):
        def force(gate, args, output):
            if not pick:
                return output
            logits = output[0]
            idx = pick["rows"].view(len(logits), cfg.num_hidden_layers, -1)[:, layer].long()
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, idx)
            if cfg.norm_topk_prob:
                probs = probs / probs.sum(dim=-1, keepdim=True)
            return logits, probs.to(logits.dtype), idx

        return force

    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts"):
            layer.mlp.gate.register_forward_hook(hook(i))
    out = []
    with torch.no_grad():
        for n, (s, p) in enumerate(zip(seqs, prompt_lens)):
            if forced is not None:
                rows = forced[n].clone()
                rows[-1] = torch.arange(cfg.num_experts_per_tok).repeat(cfg.num_hidden_layers)  # predicts nothing
                pick["rows"] = rows
            logz = torch.log_softmax(model(torch.tensor([s])).logits[0, p - 1 : len(s) - 1].float(), -1)
            out.append(logz.gather(-1, torch.tensor(s[p:]).unsqueeze(-1)).squeeze(-1))
    return out


def _run(hf: str, *, ep: int, backend: str, seqs, prompt_lens, forced, groups=None, pp: int = 1) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from asyncrl.actor.megatron_actor import Actor
    from asyncrl.actor.synthetic import tiny_actor_config

    actor_cfg = {
        "expert_model_parallel_size": ep,
        "pipeline_model_parallel_size": pp,
        "moe_routing_replay": True,
        "attention_backend": backend,
        "max_tokens_per_microbatch": 64,
    }
    algo = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}
    actor = Actor(tiny_actor_config(hf, actor=actor_cfg, algorithm=algo))
    out = {
        "replayed": [x[0] for x in actor.compute_logprobs(seqs, prompt_lens, routed_experts=forced)],
        "own": [x[0] for x in actor.compute_logprobs(seqs, prompt_lens)],
    }
    if groups is not None:  # the engine's log-probs are the replayed ones: the step's forward must replay too
        for t, lp in zip([t for g in groups for t in g.trajectories], out["replayed"]):
            t.rollout_logprobs = lp.tolist()
        before = {k: v.clone() for b in actor.iter_hf_buckets(1 << 20) for k, v in b}
        out["metrics"] = actor.train_step(groups if dist.get_rank() == 0 else None)
        after = {k: v for b in actor.iter_hf_buckets(1 << 20) for k, v in b}
        out["moved"] = max((after[k] - before[k]).abs().max().item() for k in after)
    ps.destroy_model_parallel()
    return out


def main() -> None:
    import torch.distributed as dist

    from asyncrl.actor.synthetic import synthetic_groups

    hf, mixed, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo")
    cfg = json.loads((Path(hf) / "config.json").read_text())
    cfg_mixed = json.loads((Path(mixed) / "config.json").read_text())
    groups = synthetic_groups(seed=5, num_groups=2, group_size=3, vocab_size=cfg["vocab_size"])
    trajs = [t for g in groups for t in g.trajectories]
    seqs = [t.prompt_ids + t.response_ids for t in trajs]
    prompt_lens = [len(t.prompt_ids) for t in trajs]
    forced = _forced(seqs, cfg, seed=1)
    for t, r in zip(trajs, forced):
        t.routed_experts = r.numpy()
    forced_mixed = _forced(seqs, cfg_mixed, seed=2)
    runs = {
        "fused_ep2": _run(hf, ep=2, backend="auto", seqs=seqs, prompt_lens=prompt_lens, forced=forced, groups=groups),
        "unfused_ep1": _run(hf, ep=1, backend="unfused", seqs=seqs, prompt_lens=prompt_lens, forced=forced),
        "mixed_ep2": _run(mixed, ep=2, backend="auto", seqs=seqs, prompt_lens=prompt_lens, forced=forced_mixed),
        "pp2": _run(hf, ep=1, pp=2, backend="auto", seqs=seqs, prompt_lens=prompt_lens, forced=forced),
    }
    if dist.get_rank() == 0:
        lp = proc_helpers.scaled_maxdiff
        refs = {
            "forced": _hf_logprobs(hf, seqs, prompt_lens, forced),
            "own": _hf_logprobs(hf, seqs, prompt_lens),
            "mixed_forced": _hf_logprobs(mixed, seqs, prompt_lens, forced_mixed),
            "mixed_own": _hf_logprobs(mixed, seqs, prompt_lens),
        }
        res = {}
        for name, r in runs.items():
            key = "mixed_" if name.startswith("mixed") else ""
            res[name] = {
                "replayed_vs_forced": lp(r["replayed"], refs[key + "forced"]),
                "own_vs_own": lp(r["own"], refs[key + "own"]),
                "replayed_vs_own": max((a - b).abs().max().item() for a, b in zip(r["replayed"], r["own"])),
            }
        res["step"] = {"moved": runs["fused_ep2"]["moved"], "metrics": runs["fused_ep2"]["metrics"]}
        res["seqs"] = seqs
        (work / "out.json").write_text(json.dumps(res, indent=1))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_actor_replays_the_engines_routing(tmp_path):
    pytest.importorskip("transformers")
    from asyncrl.models.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf", arch="qwen3_moe")
    mixed = make_tiny_checkpoint(
        tmp_path / "mixed", arch="qwen3_moe", num_hidden_layers=2, mlp_only_layers=[1], norm_topk_prob=False, seed=3
    )
    proc = proc_helpers.run_torchrun(Path(__file__), [str(hf), str(mixed), str(tmp_path)], timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    r = json.loads((tmp_path / "out.json").read_text())
    for name in ("fused_ep2", "unfused_ep1", "mixed_ep2", "pp2"):
        d = r[name]
        # replayed == transformers with the same experts forced; unreplayed == transformers' own routing
        assert d["replayed_vs_forced"] < proc_helpers.SCALED_REL, (name, d)
        assert d["own_vs_own"] < proc_helpers.SCALED_REL, (name, d)
        # and the forced experts change the log-probs well beyond that tolerance
        assert d["replayed_vs_own"] > 1e-2, (name, d)
    assert r["step"]["moved"] > 0 and r["step"]["metrics"]["train/num_seq_tokens"] > 0, r["step"]
    assert r["step"]["metrics"]["train/logprob_mismatch"] < 1e-5, r["step"]  # own routing: ~1e-2
    n = sum(len(s) for s in r["seqs"])  # every position replayed but each sequence's last
    assert r["step"]["metrics"]["moe/routing_replayed"] == pytest.approx((n - len(r["seqs"])) / n), r["step"]


if __name__ == "__main__":
    main()
