"""The actor on a mixture-of-experts model under torchrun (2 processes, gloo): Qwen3-MoE at TP x EP = 1x1, 1x2, 2x1.

One torchrun launch runs the worker below (this file's ``__main__``) on the tiny Qwen3-MoE (4 sparse layers,
8 experts, top-2, renormalised top-k; one variant with a dense layer, ``mlp_only_layers=[1]``, and the top-k
probabilities not renormalised, ``norm_topk_prob=false``):

- EP=2 (DP=2, each rank 4 experts): HF -> actor -> HF (``iter_hf_buckets``) bit-identical with the
  checkpoint's names; log-probs of packed sequences; one training step (the load-balancing loss on,
  coefficient 0.05) that moves the weights and reports ``moe/*``; a checkpoint saved and loaded by a fresh
  EP=2 actor (same weights), converted offline to HF (same weights).
- EP=1 (DP=2): the same batch: log-probs, loss, grad norm, ``moe/*`` and the weights after the step equal
  EP=2's; loading the EP=2 checkpoint (it has an optimizer state) is a ValueError naming the key.
- TP=2 (the actor refuses MoE training at TP > 1, megatron-core needs sequence parallelism there, so the
  model is built as the actor builds it): HF -> model -> HF bit-identical and forward-only log-probs.
- A one-trajectory batch at EP=2 (DP rank 1 gets nothing and runs a filler micro-batch) equals EP=1's step.
- The load-balancing loss alone (equal rewards): its gradient does not grow with the number of micro-batches.
- PP=2 (DP=1): round trip, log-probs, the step's loss and routing metrics equal EP=1's (padding excluded).
- The mixed model at EP=2: round trip, log-probs, one step.

Rank 0 computes the reference log-probs with transformers' ``Qwen3MoeForCausalLM``.

A second launch (4 processes) runs PP x EP = 2 x 2 (DP=2), 1 x 2 and 1 x 4 (DP=4): round trip, log-probs, one
step: EP=4 == EP=2 (loss, grad norm, weights), PP=2 the same loss and routing, per-stage per-EP-rank files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import proc_helpers  # tests/integration/proc_helpers.py
import pytest
import torch

AUX_COEFF = 0.05


def _algo() -> dict:
    return {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "entropy_coef": 0.01}


def _actor(hf: str, ep: int, pp: int = 1, budget: int = 48, algo: dict | None = None):
    from asyncrl.actor.megatron_actor import Actor
    from asyncrl.actor.synthetic import tiny_actor_config

    actor = {"expert_model_parallel_size": ep, "pipeline_model_parallel_size": pp, "moe_aux_loss_coeff": AUX_COEFF}
    actor["max_tokens_per_microbatch"] = budget
    return Actor(tiny_actor_config(hf, actor=actor, algorithm=algo or _algo()))


def _weights(actor) -> dict:
    return {k: v for b in actor.iter_hf_buckets(64 * 1024) for k, v in b}


def _exact(weights: dict, hf: str, *, every_rank: bool = True) -> bool:
    """The HF checkpoint's tensors, bit for bit (in the same order on every rank, unless at PP > 1 where the other
    ranks get their own stage's)."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    w0 = load_file(str(Path(hf) / "model.safetensors"))
    orders = [None] * dist.get_world_size()
    dist.all_gather_object(orders, list(weights))
    same_order = not every_rank or all(o == orders[0] for o in orders)
    return same_order and sorted(weights) == sorted(w0) and all(torch.equal(weights[k], w0[k]) for k in w0)


def _train_run(hf: str, ep: int, seqs, prompt_lens, groups, ckpt: Path | None = None, pp: int = 1) -> dict:
    """Round trip, log-probs, one step; at EP=2 save ``ckpt`` and resume from it, at EP=1 try to resume it."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    actor = _actor(hf, ep, pp)
    out = {"exact": _exact(_weights(actor), hf, every_rank=pp == 1), "lps": actor.compute_logprobs(seqs, prompt_lens)}
    out["metrics"] = actor.train_step(groups if dist.get_rank() == 0 else None)
    out["weights"] = _weights(actor)
    if ckpt is not None and ep == 2:
        actor.save_checkpoint(ckpt)
        ps.destroy_model_parallel()
        again = _actor(hf, ep)
        again.load_checkpoint(ckpt)
        w = _weights(again)
        out["resumed_equal"] = all(torch.equal(w[k], out["weights"][k]) for k in w)
        out["files"] = sorted(p.name for p in ckpt.glob("*_tp*"))
    elif ckpt is not None:
        try:
            actor.load_checkpoint(ckpt)
            out["ep_mismatch"] = ""
        except ValueError as e:
            out["ep_mismatch"] = str(e)
    ps.destroy_model_parallel()
    return out


def _one_sample_run(hf: str, ep: int, groups) -> dict:
    """A one-trajectory batch: DP rank 1 gets no sample; at EP=2 it runs a filler micro-batch (else: a hang)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    one = [type(groups[1])(group_id=9, item=groups[1].item, epoch=0, trajectories=groups[1].trajectories[:1])]
    actor = _actor(hf, ep)
    m = actor.train_step(one if dist.get_rank() == 0 else None)
    ps.destroy_model_parallel()
    return m


def _aux_only_run(hf: str, groups, budget: int) -> dict:
    """EP=2, every reward equal (no policy gradient), no entropy bonus: the load-balancing loss alone."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    for g in groups:
        for t in g.trajectories:
            t.reward = 1.0
    actor = _actor(hf, 2, budget=budget, algo={"entropy_coef": 0.0})
    m = actor.train_step(groups if dist.get_rank() == 0 else None)
    ps.destroy_model_parallel()
    return m


def _tp2_run(hf: str, seqs, prompt_lens) -> dict:
    """TP=2, EP=1: the model as the actor builds and loads it; round trip and forward-only log-probs."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from asyncrl.actor.logprobs import logprobs_from_logits
    from asyncrl.actor.model import actor_spec, build_gpt_model, padded_vocab_size
    from asyncrl.actor.schedule import MicroBatch, PlainSchedule
    from asyncrl.actor.weights import ExpertShards, iter_hf_buckets, load_hf_into_model
    from asyncrl.cluster.megatron_cpu import apply_cpu_shims

    apply_cpu_shims()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    spec, r, group = actor_spec(hf), ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    model = build_gpt_model(spec, tp=2)
    load_hf_into_model(model, hf, spec, tp_rank=r, tp=2, experts=ExpertShards.current(spec))
    weights = {k: v for b in iter_hf_buckets(model, spec, 64 * 1024, tp_group=group, tp=2) for k, v in b}
    model.eval()  # megatron-core refuses MoE *training* at TP > 1 without sequence parallelism
    sched, vocab = PlainSchedule(torch.device("cpu"), "sdpa"), padded_vocab_size(spec.vocab_size, 2)
    lps = []
    with torch.no_grad():
        for p in sched.pack([(seqs, prompt_lens)]):
            lp, _ = logprobs_from_logits(
                sched.forward(model, [MicroBatch(p)], lambda it, logits: logits)[0],
                p,
                vocab_start=r * vocab // 2,
                true_vocab=spec.vocab_size,
                tp_group=group,
                tp=2,
                with_entropy=False,
                temperature=1.0,
            )
            lps += [lp[p.seq_of_token == k] for k in range(len(seqs))]
    ps.destroy_model_parallel()
    return {"exact": _exact(weights, hf), "lps": lps}


def _hf_logprobs(hf: str, seqs, prompt_lens) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    out = []
    with torch.no_grad():
        for s, p in zip(seqs, prompt_lens):
            logz = torch.log_softmax(model(torch.tensor([s])).logits[0, p - 1 : len(s) - 1].float(), -1)
            out.append(logz.gather(-1, torch.tensor(s[p:]).unsqueeze(-1)).squeeze(-1))
    return out


def _engine_logprobs(hf: str, seqs, prompt_lens) -> list[torch.Tensor]:
    """The CPU engine's model (what a rollout samples from) on the same tokens: one prefill per sequence."""
    from asyncrl.cpu_engine.kv_pool import KVPool
    from asyncrl.cpu_engine.model import load_model

    m = load_model(hf)
    out = []
    with torch.no_grad():
        for s, p in zip(seqs, prompt_lens):
            h = m.forward(torch.tensor(s), torch.tensor([0]), torch.tensor([len(s)]), KVPool(m.spec, 1), row0=0)
            logz = torch.log_softmax(m.logits(h)[p - 1 : len(s) - 1].float(), -1)
            out.append(logz.gather(-1, torch.tensor(s[p:]).unsqueeze(-1)).squeeze(-1))
    return out


def _four_ranks(hf: str, work: Path) -> None:
    """PP x EP = 2 x 2, 1 x 2, 1 x 4 on 4 ranks (see the module docstring)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from asyncrl.actor.synthetic import synthetic_groups

    vocab = json.loads((Path(hf) / "config.json").read_text())["vocab_size"]
    groups = synthetic_groups(seed=7, num_groups=4, group_size=4, vocab_size=vocab)
    seqs = [t.prompt_ids + t.response_ids for g in groups[:2] for t in g.trajectories]
    prompt_lens = [len(t.prompt_ids) for g in groups[:2] for t in g.trajectories]
    res = {}
    for pp, ep in ((2, 2), (1, 2), (1, 4)):
        actor = _actor(hf, ep, pp)
        exact = _exact(_weights(actor), hf, every_rank=pp == 1)
        lps = [x[0] for x in actor.compute_logprobs(seqs, prompt_lens)]
        m = actor.train_step(groups if dist.get_rank() == 0 else None)
        w = _weights(actor)
        actor.save_checkpoint(work / f"pp{pp}_ep{ep}")
        ps.destroy_model_parallel()
        res[(pp, ep)] = (exact, lps, m, w)
    if dist.get_rank() == 0:
        (_, lp_base, m12, w12), (_, _, m14, w14) = res[(1, 2)], res[(1, 4)]
        out = {
            "exact": [r[0] for r in res.values()],
            "lp": [proc_helpers.scaled_maxdiff(r[1], lp_base) for r in res.values()],
            "metrics": [m12, m14, res[(2, 2)][2]],
            "w_ep4_ep2": max((w14[k] - w12[k]).abs().max().item() for k in w12),
            "files": sorted(p.name for p in (work / "pp2_ep2").glob("model_*")),
        }
        (work / "out4.json").write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch.distributed as dist

    from asyncrl.actor.synthetic import synthetic_groups

    if sys.argv[1] == "four":
        dist.init_process_group("gloo")
        return _four_ranks(sys.argv[2], Path(sys.argv[3]))
    hf, mixed, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo")
    vocab = json.loads((Path(hf) / "config.json").read_text())["vocab_size"]
    groups = synthetic_groups(seed=7, num_groups=4, group_size=4, vocab_size=vocab)
    seqs = [t.prompt_ids + t.response_ids for g in groups[:2] for t in g.trajectories]
    prompt_lens = [len(t.prompt_ids) for g in groups[:2] for t in g.trajectories]
    ep2 = _train_run(hf, 2, seqs, prompt_lens, groups, work / "ckpt_ep2")
    ep1 = _train_run(hf, 1, seqs, prompt_lens, groups, work / "ckpt_ep2")
    pp2 = _train_run(hf, 1, seqs, prompt_lens, groups, pp=2)
    tp2 = _tp2_run(hf, seqs, prompt_lens)
    mixed_ep2 = _train_run(mixed, 2, seqs, prompt_lens, groups)
    one_sample = [_one_sample_run(hf, ep, groups) for ep in (2, 1)]
    aux_only = [_aux_only_run(hf, groups, budget) for budget in (48, 1 << 20)]
    if dist.get_rank() == 0:
        from asyncrl.actor.checkpoint import actor_checkpoint_to_hf
        from asyncrl.models.safetensors_io import SafetensorsReader

        ref, ref_mixed = _hf_logprobs(hf, seqs, prompt_lens), _hf_logprobs(mixed, seqs, prompt_lens)
        lp = proc_helpers.scaled_maxdiff
        offline = SafetensorsReader(actor_checkpoint_to_hf(work / "ckpt_ep2", work / "offline")).to_dict()
        res = {
            "exact": [ep2["exact"], ep1["exact"], pp2["exact"], tp2["exact"], mixed_ep2["exact"]],
            "lp_hf": [lp([x[0] for x in r["lps"]], ref) for r in (ep2, ep1, pp2)] + [lp(tp2["lps"], ref)],
            "lp_hf_mixed": lp([x[0] for x in mixed_ep2["lps"]], ref_mixed),
            "lp_engine": lp([x[0] for x in ep2["lps"]], _engine_logprobs(hf, seqs, prompt_lens)),
            "lp_mean": sum(x.mean().item() for x in ref) / len(ref),
            "metrics": [ep2["metrics"], ep1["metrics"], mixed_ep2["metrics"], pp2["metrics"]],
            "w_ep1_ep2": max((ep1["weights"][k] - ep2["weights"][k]).abs().max().item() for k in ep1["weights"]),
            "w_moved": max(
                (ep2["weights"][k] - SafetensorsReader(hf).get(k)).abs().max().item() for k in ep2["weights"]
            ),
            "resumed_equal": ep2["resumed_equal"],
            "offline_equal": sorted(offline) == sorted(ep2["weights"])
            and all(torch.equal(offline[k], ep2["weights"][k]) for k in offline),
            "files": ep2["files"],
            "ep_mismatch": ep1["ep_mismatch"],
            "aux_only": aux_only,
            "one_sample": one_sample,
        }
        (work / "out.json").write_text(json.dumps(res, indent=1))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_actor_moe_expert_parallel(tmp_path):
    pytest.importorskip("transformers")
    from asyncrl.models.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf", arch="qwen3_moe")
    mixed = make_tiny_checkpoint(
        tmp_path / "mixed", arch="qwen3_moe", num_hidden_layers=2, mlp_only_layers=[1], norm_topk_prob=False, seed=3
    )
    proc = proc_helpers.run_torchrun(Path(__file__), [str(hf), str(mixed), str(tmp_path)], timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    r = json.loads((tmp_path / "out.json").read_text())
    # HF -> actor -> HF bit-identical, the checkpoint's names in one order on every rank, at EP=2, EP=1, TP=2 and
    # for the mixed model
    assert r["exact"] == [True] * 5
    # log-probs equal transformers' (Qwen3MoeForCausalLM) within the dense tests' tolerance
    assert all(d < proc_helpers.SCALED_REL for d in r["lp_hf"]), r["lp_hf"]
    assert r["lp_hf_mixed"] < proc_helpers.SCALED_REL and r["lp_mean"] < -3.0
    # the actor (EP=2) and the CPU engine, which samples the rollouts, agree on the same tokens
    assert r["lp_engine"] < proc_helpers.SCALED_REL, r["lp_engine"]
    m2, m1, mm, mp = r["metrics"]
    assert m2["train/step_skipped"] == 0.0 and r["w_moved"] > 5e-4  # the step moved the weights
    # EP=2 == EP=1 on the same batch: loss, grad norm, routing metrics, the weights after one Adam step
    assert abs(m2["train/loss"] - m1["train/loss"]) < 1e-5 * max(1.0, abs(m1["train/loss"]))
    assert abs(m2["train/grad_norm"] - m1["train/grad_norm"]) < proc_helpers.GRAD_NORM_REL * m1["train/grad_norm"]
    moe_keys = {"moe/aux_loss", "moe/expert_load/max_over_mean", "moe/expert_load/min_over_mean"}
    moe_keys |= {f"moe/expert_load/expert_{e}" for e in range(8)}
    assert {k for k in m2 if k.startswith("moe/")} == moe_keys == {k for k in mm if k.startswith("moe/")}
    for k in moe_keys:
        assert m2[k] == pytest.approx(m1[k], rel=1e-6, abs=1e-9), k
    assert r["w_ep1_ep2"] < proc_helpers.ADAM_STEP_REL * 1e-3
    # the unweighted load-balancing loss of a random router is ~1 (exactly 1 when balanced); loads around their mean
    assert 0.9 < m2["moe/aux_loss"] < 2.0
    assert m2["moe/expert_load/max_over_mean"] > 1.0 > m2["moe/expert_load/min_over_mean"] >= 0.0
    assert sum(m2[f"moe/expert_load/expert_{e}"] for e in range(8)) == pytest.approx(1.0)
    # PP=2 (DP=1: other micro-batches, padded to one shape): the same loss, and the same tokens routed (the padding
    # is left out: megatron-core's padding_mask); the load-balancing loss is its own micro-batches' mean
    assert abs(mp["train/loss"] - m1["train/loss"]) < 1e-5 * max(1.0, abs(m1["train/loss"]))
    for k in moe_keys - {"moe/aux_loss"}:
        assert mp[k] == pytest.approx(m1[k], rel=1e-6, abs=1e-9), k
    assert 0.9 < mp["moe/aux_loss"] < 2.0 and mp["moe/aux_loss"] != m1["moe/aux_loss"]
    # a DP rank without samples at EP=2 runs a filler micro-batch: the step equals EP=1's (where it runs none)
    o2, o1 = r["one_sample"]
    assert o2["train/num_tokens"] == o1["train/num_tokens"] > 0 and o2["train/step_skipped"] == 0.0
    for k in ("train/loss", "train/grad_norm", *moe_keys):
        assert o2[k] == pytest.approx(o1[k], rel=1e-5, abs=1e-9), k
    # the load-balancing loss alone moves the router: its gradient is a mean over micro-batches (megatron-core's
    # scale, 1 / micro-batches per rank), so 5 micro-batches per rank give about the gradient of 1, not 5 times it
    many, one = r["aux_only"]
    assert many["train/loss"] == one["train/loss"] == 0.0
    assert many["train/num_microbatches"] >= 4 and one["train/num_microbatches"] == 1
    assert one["train/grad_norm"] > 1e-3 and 0.5 < many["train/grad_norm"] / one["train/grad_norm"] < 2.0
    # checkpoint at EP=2: per-EP-rank files, resumed bit-identically, converted offline to the same HF weights
    assert r["files"] == [
        "model_tp00_ep00.safetensors",
        "model_tp00_ep01.safetensors",
        "optim_tp00_ep00.pt",
        "optim_tp00_ep01.pt",
    ]
    assert r["resumed_equal"] and r["offline_equal"]
    assert "actor.expert_model_parallel_size=1" in r["ep_mismatch"] and "EP=2" in r["ep_mismatch"]


@pytest.mark.slow
def test_actor_moe_pipeline_and_expert_parallel_on_four_ranks(tmp_path):
    from asyncrl.models.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf", arch="qwen3_moe")
    proc = proc_helpers.run_torchrun(Path(__file__), ["four", str(hf), str(tmp_path)], nproc=4, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    r = json.loads((tmp_path / "out4.json").read_text())
    assert r["exact"] == [True, True, True] and max(r["lp"]) < proc_helpers.SCALED_REL
    m12, m14, m22 = r["metrics"]
    # EP=4 == EP=2 at DP=4 (the same micro-batches): the step, the routing
    assert abs(m14["train/grad_norm"] - m12["train/grad_norm"]) < proc_helpers.GRAD_NORM_REL * m12["train/grad_norm"]
    assert r["w_ep4_ep2"] < proc_helpers.ADAM_STEP_REL * 1e-3
    # PP=2 x EP=2 (DP=2: other micro-batches): the same loss and tokens routed
    for m in (m14, m22):
        assert abs(m["train/loss"] - m12["train/loss"]) < 1e-5 * max(1.0, abs(m12["train/loss"]))
        for k in ("moe/expert_load/max_over_mean", "moe/expert_load/min_over_mean", "moe/expert_load/expert_3"):
            assert m[k] == pytest.approx(m12[k], rel=1e-6), k
    assert r["files"] == [f"model_tp00_ep{e:02d}_pp{s:02d}.safetensors" for e in range(2) for s in range(2)]


if __name__ == "__main__":
    main()
