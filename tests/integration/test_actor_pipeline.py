"""Pipeline parallelism of the actor under torchrun on gloo: PP=2 equals PP=1.

Launch 1 (2 ranks): the tiny Qwen2 model (4 layers) at PP=1 (DP=2) and at PP=2 (layers split
2 + 2): the HF export (``iter_hf_buckets``: same names, order, buckets and values as PP=1, equal to
the HF file), log-probs + entropy of packed sequences over several micro-batches (within 1e-5 of their scale),
one training step (metrics and weights); the same for a Llama with tied embeddings (the last
stage's copy of the word embeddings, kept in sync by the embedding-group all-reduce). Then a PP=2
checkpoint: save after step 1, train step 2; a fresh actor loads the checkpoint and redoes step 2
(decoupled PPO + KL to a reference model: forward-only schedules inside the step) bit-identically,
and a model-only checkpoint converted offline (PP=1 files) loads into the PP=2 stages.
Launch 2 (4 ranks): TP=2 x PP=2 and PP=2 x DP=2 against TP=2 x DP=2 (log-probs before and after
one step, the step's metrics and weights, the export), and a one-sequence batch at PP=2 x DP=2
(one pipeline has no sample); the distributed optimizer at PP=2 x DP=2: save, step, reload, redo
the step, identical.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import proc_helpers  # tests/integration/proc_helpers.py
import pytest
import torch

GROUP_SEED = 11
LR = 1e-3  # the actor's learning rate (asyncrl.actor.synthetic.tiny_actor_config)


def _cfg(hf: str, *, tp: int = 1, pp: int = 1, save_hf: bool = False, **algo):
    from asyncrl.actor.synthetic import tiny_actor_config

    return tiny_actor_config(
        hf,
        actor={
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp,
            "max_tokens_per_microbatch": 48,
            "adam_eps": 1e-6,
        },
        algorithm={"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "entropy_coef": 0.01, **algo},
        runner={"max_steps": 4, "save_hf": save_hf},
    )


def _run(hf: str, tp: int, pp: int, seqs, prompt_lens, groups, *, one_sequence: bool = False) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from asyncrl.actor.megatron_actor import Actor

    actor = Actor(_cfg(hf, tp=tp, pp=pp))
    b0 = list(actor.iter_hf_buckets(16 * 1024))
    lps = actor.compute_logprobs(seqs, prompt_lens, with_entropy=True)
    metrics = actor.train_step(groups if dist.get_rank() == 0 else None)
    b1 = list(actor.iter_hf_buckets(1 << 30))
    # after the step (with tied embeddings: the last stage's copy must have moved with the embedding)
    lps_after = actor.compute_logprobs(seqs[:4], prompt_lens[:4])
    one = None
    if one_sequence:  # one DP rank's pipeline gets no sample: it skips the schedule, joins the rest
        batch = [copy.copy(groups[1])]
        batch[0].trajectories = groups[1].trajectories[:1]
        one = actor.train_step(batch if dist.get_rank() == 0 else None)["train/num_tokens"]
    ps.destroy_model_parallel()
    return {
        "export0": [[(k, v) for k, v in b] for b in b0],
        "lps": lps,
        "lps_after": lps_after,
        "metrics": metrics,
        "weights": {k: v for b in b1 for k, v in b},
        "one": one,
    }


def _compare(r1: dict, r2: dict, hf: str) -> dict:
    from safetensors.torch import load_file

    w0 = load_file(str(Path(hf) / "model.safetensors"))

    maxdiff = proc_helpers.scaled_maxdiff

    names1 = [[k for k, _ in b] for b in r1["export0"]]
    names2 = [[k for k, _ in b] for b in r2["export0"]]
    flat2 = {k: v for b in r2["export0"] for k, v in b}
    m1, m2 = r1["metrics"], r2["metrics"]
    keys = ("train/loss", "train/grad_norm", "train/entropy", "train/clip_fraction", "train/num_tokens")
    return {
        "buckets_equal": names1 == names2 and len(names2) > 3,
        "export_exact": sorted(flat2) == sorted(w0) and all(torch.equal(flat2[k], w0[k]) for k in w0),
        "lp": maxdiff([x[0] for x in r1["lps"]], [x[0] for x in r2["lps"]]),
        "ent": maxdiff([x[1] for x in r1["lps"]], [x[1] for x in r2["lps"]]),
        "n_lps": [len(r1["lps"]), len(r2["lps"])],
        "lp_after": maxdiff([x[0] for x in r1["lps_after"]], [x[0] for x in r2["lps_after"]]),
        "metrics": {k: [m1[k], m2[k]] for k in keys},
        "num_microbatches": m2["train/num_microbatches"],
        "w": max((r1["weights"][k] - r2["weights"][k]).abs().max().item() for k in w0),
        "w_moved": max((r2["weights"][k] - w0[k]).abs().max().item() for k in w0),
        "names": sorted(r2["weights"]) == sorted(w0),
    }


def _resume(hf: str, work: Path, vocab: int) -> dict:
    """PP=2: save after step 1, step 2; a fresh actor loads the checkpoint and redoes step 2."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from asyncrl.actor.megatron_actor import Actor
    from asyncrl.actor.synthetic import synthetic_groups

    rank = dist.get_rank()
    cfg = _cfg(hf, pp=2, save_hf=True, off_policy_correction="decoupled", kl_coef=0.05, tis_cap=3.0)

    def batch(s):
        return synthetic_groups(seed=200 + s, num_groups=3, group_size=4, vocab_size=vocab) if rank == 0 else None

    def step(actor, s):
        m = actor.train_step(batch(s))
        return {k: v for k, v in m.items() if not k.startswith("time/") and k != "train/tokens_per_s"}

    actor = Actor(cfg)
    step(actor, 1)
    actor.save_checkpoint(work / "ckpt_pp2", step=1)
    first = step(actor, 2)
    w_first = {k: v for b in actor.iter_hf_buckets(1 << 30) for k, v in b}
    ps.destroy_model_parallel()
    actor = Actor(cfg)
    meta = actor.load_checkpoint(work / "ckpt_pp2")
    again = step(actor, 2)
    w_again = {k: v for b in actor.iter_hf_buckets(1 << 30) for k, v in b}
    # a model-only checkpoint converted offline (PP=1 files) loads into the PP=2 stages
    actor.load_checkpoint(work / "converted")
    w_conv = {k: v for b in actor.iter_hf_buckets(1 << 30) for k, v in b}
    ps.destroy_model_parallel()
    from safetensors.torch import load_file

    w0 = load_file(str(Path(hf) / "model.safetensors"))
    return {
        "converted_exact": sorted(w_conv) == sorted(w0) and all(torch.equal(w_conv[k], w0[k]) for k in w0),
        "same_metrics": first == again,
        "kl": first["train/kl"],
        "same_weights": sorted(w_first) == sorted(w_again)
        and all(torch.equal(w_first[k], w_again[k]) for k in w_first),
        "meta_pp": meta["pp"],
        "w_ckpt": w_first,
    }


def _dopt_resume(hf: str, work: Path, vocab: int) -> bool:
    """PP=2 x DP=2 with the distributed optimizer: save, step, reload, redo the step: identical."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from asyncrl.actor.megatron_actor import Actor
    from asyncrl.actor.synthetic import synthetic_groups, tiny_actor_config

    rank = dist.get_rank()
    cfg = tiny_actor_config(
        hf,
        actor={"pipeline_model_parallel_size": 2, "use_distributed_optimizer": True, "max_tokens_per_microbatch": 48},
    )

    def batch(s):
        return synthetic_groups(seed=300 + s, num_groups=3, group_size=4, vocab_size=vocab) if rank == 0 else None

    actor = Actor(cfg)
    actor.train_step(batch(1))
    actor.save_checkpoint(work / "ckpt_dopt")
    m1 = actor.train_step(batch(2))
    w1 = {k: v for b in actor.iter_hf_buckets(1 << 30) for k, v in b}
    ps.destroy_model_parallel()
    actor = Actor(cfg)
    actor.load_checkpoint(work / "ckpt_dopt")
    m2 = actor.train_step(batch(2))
    w2 = {k: v for b in actor.iter_hf_buckets(1 << 30) for k, v in b}
    ps.destroy_model_parallel()
    keys = ("train/loss", "train/grad_norm", "train/lr")
    return all(m1[k] == m2[k] for k in keys) and all(torch.equal(w1[k], w2[k]) for k in w1)


def main() -> None:
    import torch.distributed as dist

    from asyncrl.actor.synthetic import synthetic_groups

    mode, out, hfs = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res: dict = {}
    for hf in hfs:
        vocab = json.loads((Path(hf) / "config.json").read_text())["vocab_size"]
        groups = synthetic_groups(seed=GROUP_SEED, num_groups=4, group_size=4, vocab_size=vocab)
        seqs = [t.prompt_ids + t.response_ids for g in groups[:2] for t in g.trajectories]
        prompt_lens = [len(t.prompt_ids) for g in groups[:2] for t in g.trajectories]
        tp = 2 if mode == "four_ranks" else 1
        r1 = _run(hf, tp, 1, seqs, prompt_lens, groups)
        r2 = _run(hf, tp, 2, seqs, prompt_lens, groups)
        if rank == 0:
            res[hf] = _compare(r1, r2, hf)
        if mode == "four_ranks":  # PP=2 x DP=2 (TP=1): DP replicas of a pipeline
            r3 = _run(hf, 1, 2, seqs, prompt_lens, groups, one_sequence=True)
            same = _dopt_resume(hf, out.parent, vocab)
            if rank == 0:
                res["dp2"] = _compare(r1, r3, hf)
                res["dp2_one_tokens"] = r3["one"]
                res["dopt_resume_same"] = same
    if mode == "pp2":
        vocab = json.loads((Path(hfs[0]) / "config.json").read_text())["vocab_size"]
        r = _resume(hfs[0], out.parent, vocab)
        if rank == 0:
            torch.save(r.pop("w_ckpt"), out.parent / "w_step2.pt")
            res["resume"] = r
    if rank == 0:
        out.write_text(json.dumps(res, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _check(r: dict) -> None:
    assert r["buckets_equal"] and r["export_exact"] and r["names"], r
    assert r["n_lps"][0] == r["n_lps"][1] == 8
    tol = proc_helpers.SCALED_REL  # lp, ent, lp_after: relative to the values' scale (see proc_helpers)
    assert r["lp"] < tol and r["ent"] < tol and r["lp_after"] < tol, r
    for k, (a, b) in r["metrics"].items():
        rel = proc_helpers.GRAD_NORM_REL if k == "train/grad_norm" else 1e-5
        assert abs(a - b) <= rel * max(1.0, abs(a)), (k, a, b)
    assert r["num_microbatches"] >= 2  # the token budget split the batch: 1F1B over several micro-batches
    assert r["w_moved"] > 5e-4 and r["w"] < proc_helpers.ADAM_STEP_REL * LR, r


@pytest.mark.slow
def test_actor_pp2_equals_pp1_and_resumes(tmp_path):
    from safetensors.torch import load_file

    from asyncrl.actor.checkpoint import actor_checkpoint_to_hf, hf_to_actor_checkpoint
    from asyncrl.models.tiny import make_tiny_checkpoint

    qwen = make_tiny_checkpoint(tmp_path / "qwen2", num_hidden_layers=4, vocab_size=1000)
    llama = make_tiny_checkpoint(
        tmp_path / "llama", arch="llama", num_hidden_layers=2, seed=2, tie_word_embeddings=True, vocab_size=1000
    )
    hf_to_actor_checkpoint(qwen, tmp_path / "converted", tp=1)
    out = tmp_path / "out.json"
    proc = proc_helpers.run_torchrun(Path(__file__), ["pp2", str(out), str(qwen), str(llama)], nproc=2)
    assert proc.returncode == 0, proc.stderr[-5000:]
    r = json.loads(out.read_text())
    _check(r[str(qwen)])
    _check(r[str(llama)])  # tied embeddings: the last stage's copy trains like the PP=1 shared weight
    res = r["resume"]
    assert res["same_metrics"] and res["same_weights"] and res["meta_pp"] == 2 and res["kl"] > 0, res
    assert res["converted_exact"]
    # the PP=2 checkpoint converts offline to the full HF model (stage files merged)
    ckpt = tmp_path / "ckpt_pp2"
    assert (ckpt / "model_tp00_pp00.safetensors").is_file() and (ckpt / "optim_tp00_pp01.pt").is_file()
    conv = load_file(str(actor_checkpoint_to_hf(ckpt, tmp_path / "conv") / "model.safetensors"))
    assert sorted(conv) == sorted(load_file(str(qwen / "model.safetensors")))
    # ... and equals the HF export written at save time (iter_hf_buckets gathered on rank 0)
    exported = load_file(str(ckpt / "hf_export" / "model.safetensors"))
    assert sorted(exported) == sorted(conv) and all(torch.equal(exported[k], conv[k]) for k in conv)


@pytest.mark.slow
def test_actor_tp2_pp2_and_pp2_dp2_on_four_ranks(tmp_path):
    from asyncrl.models.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "qwen3", arch="qwen3", num_hidden_layers=2, vocab_size=1000, seed=3)
    out = tmp_path / "out.json"
    proc = proc_helpers.run_torchrun(Path(__file__), ["four_ranks", str(out), str(hf)], nproc=4)
    assert proc.returncode == 0, proc.stderr[-5000:]
    r = json.loads(out.read_text())
    _check(r[str(hf)])  # TP=2 x PP=2 == TP=2 x DP=2
    _check(r["dp2"])  # PP=2 x DP=2 == TP=2 x DP=2
    assert r["dp2_one_tokens"] > 0
    assert r["dopt_resume_same"]  # the distributed optimizer's per-rank state at PP=2 x DP=2


if __name__ == "__main__":
    main()
