"""Kill-and-resume: training resumed from a checkpoint continues bit-identically (torchrun, TP=2).

Launch 1 (``full-then-crash``): an uninterrupted 4-step run (warmup + cosine LR, decoupled PPO,
KL to the reference model, step 3 fed a NaN log-prob so it is skipped) records its metrics and
final weights; then a fresh actor trains 2 steps, saves a checkpoint (with the HF export), starts
step 3 and dies with ``os._exit`` (no clean-up). Launch 2 (``resume``): a fresh actor loads the
checkpoint and trains steps 3-4: metrics and weights must equal the uninterrupted run exactly.
Then, with the distributed optimizer (TP=1, DP=2): save, step, reload, redo the step: identical;
a one-sequence batch (a DP rank without samples) and an empty batch (no update); and loading a
checkpoint converted offline by ``hf_to_actor_checkpoint`` (model only).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import proc_helpers  # tests/integration/proc_helpers.py
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
NUM_STEPS = 4
CKPT_STEP = 2
CRASH_CODE = 17


def run_torchrun(script: Path, args: list[str], *, nproc: int = 2, timeout_s: float = 180):
    return proc_helpers.run_torchrun(script, args, nproc=nproc, timeout_s=timeout_s)


def _batch(step: int, vocab: int):
    from asyncrl.actor.synthetic import synthetic_groups

    groups = synthetic_groups(seed=100 + step, num_groups=3, group_size=4, vocab_size=vocab)
    if step == 3:  # a broken batch: the step must be skipped, not applied
        groups[1].trajectories[0].rollout_logprobs[0] = float("nan")
        groups[1].trajectories[0].loss_mask[0] = 1
    return groups


def _actor(hf: str, *, tp: int = 2, distributed_optimizer: bool = False):
    from asyncrl.actor.megatron_actor import Actor
    from asyncrl.actor.synthetic import tiny_actor_config

    cfg = tiny_actor_config(
        hf,
        actor={
            "tensor_model_parallel_size": tp,
            "lr_warmup_steps": 1,
            "lr_schedule": "cosine",
            "min_lr": 1e-4,
            "max_tokens_per_microbatch": 64,
            "use_distributed_optimizer": distributed_optimizer,
        },
        algorithm={"off_policy_correction": "decoupled", "kl_coef": 0.05, "tis_cap": 3.0},
        runner={"max_steps": NUM_STEPS, "save_hf": True},
    )
    return Actor(cfg)


def _train(actor, steps, vocab, rank):
    out = {}
    for s in steps:
        m = actor.train_step(_batch(s, vocab) if rank == 0 else None)
        out[s] = {k: v for k, v in m.items() if not k.startswith("time/") and k != "train/tokens_per_s"}
    return out


def _weights(actor):
    return {k: v for b in actor.iter_hf_buckets(1 << 30) for k, v in b}


def main() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    mode, hf, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    vocab = json.loads((Path(hf) / "config.json").read_text())["vocab_size"]
    if mode == "full-then-crash":
        actor = _actor(hf)
        full = _train(actor, range(1, NUM_STEPS + 1), vocab, rank)
        w = _weights(actor)
        if rank == 0:
            (work / "full.json").write_text(json.dumps({"metrics": full, "version": actor.version}))
            torch.save(w, work / "full_weights.pt")
        ps.destroy_model_parallel()
        actor = _actor(hf)
        _train(actor, range(1, CKPT_STEP + 1), vocab, rank)
        actor.save_checkpoint(work / "ckpt", step=CKPT_STEP)
        if rank == 0:
            torch.save(_weights(actor), work / "ckpt_weights.pt")
        else:
            _weights(actor)
        actor.train_step(_batch(CKPT_STEP + 1, vocab) if rank == 0 else None)
        sys.stdout.flush()
        os._exit(CRASH_CODE)  # killed: no checkpoint of step 3, no clean shutdown
    elif mode == "resume":
        actor = _actor(hf)
        meta = actor.load_checkpoint(work / "ckpt")
        assert meta["step"] == CKPT_STEP and actor.version == CKPT_STEP, meta
        resumed = _train(actor, range(CKPT_STEP + 1, NUM_STEPS + 1), vocab, rank)
        w = _weights(actor)
        if rank == 0:
            (work / "resumed.json").write_text(json.dumps({"metrics": resumed, "version": actor.version}))
            torch.save(w, work / "resumed_weights.pt")
        ps.destroy_model_parallel()
        # the distributed optimizer (TP=1, DP=2: state sharded over DP): save, step, reload, redo the step
        actor = _actor(hf, tp=1, distributed_optimizer=True)
        _train(actor, [1], vocab, rank)
        actor.save_checkpoint(work / "ckpt_dopt")
        first = _train(actor, [2], vocab, rank)
        w_first = _weights(actor)
        actor.load_checkpoint(work / "ckpt_dopt")
        again = _train(actor, [2], vocab, rank)
        w_again = _weights(actor)
        # a batch of one sequence (one DP rank gets nothing) and an empty batch: no hang, no update
        from asyncrl.actor.synthetic import synthetic_groups

        one = synthetic_groups(seed=9, num_groups=1, group_size=1, vocab_size=vocab)
        m_one = actor.train_step(one if rank == 0 else None)
        w_one = _weights(actor)
        m_empty = actor.train_step([] if rank == 0 else None)
        w_empty = _weights(actor)
        # a checkpoint converted offline from another HF checkpoint loads as the model (no optimizer)
        meta = actor.load_checkpoint(work / "converted")
        w_conv = _weights(actor)
        if rank == 0:
            from safetensors.torch import load_file

            other = load_file(str(work / "hf_other" / "model.safetensors"))
            same = first == again and all(torch.equal(w_first[k], w_again[k]) for k in w_first)
            result = {
                "same": same,
                "version": actor.version,
                "grad_norm": first[2]["train/grad_norm"],
                "one_tokens": m_one["train/num_tokens"],
                "empty": m_empty["train/empty_batch"],
                "empty_unchanged": all(torch.equal(w_one[k], w_empty[k]) for k in w_one),
                "converted_exact": all(torch.equal(other[k], w_conv[k]) for k in other),
                "converted_step": meta["step"],
            }
            (work / "dopt.json").write_text(json.dumps(result))
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.slow
def test_kill_and_resume_is_bit_identical(tmp_path):
    from safetensors.torch import load_file

    from asyncrl.actor.checkpoint import actor_checkpoint_to_hf, hf_to_actor_checkpoint
    from asyncrl.models.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf", arch="qwen3", num_hidden_layers=2)
    hf_to_actor_checkpoint(
        make_tiny_checkpoint(tmp_path / "hf_other", arch="qwen3", num_hidden_layers=2, seed=7),
        tmp_path / "converted",
        tp=1,
    )
    p1 = run_torchrun(Path(__file__), ["full-then-crash", str(hf), str(tmp_path)])
    assert p1.returncode != 0 and (tmp_path / "full.json").is_file(), p1.stderr[-4000:]
    assert (tmp_path / "ckpt" / "meta.json").is_file()
    p2 = run_torchrun(Path(__file__), ["resume", str(hf), str(tmp_path)])
    assert p2.returncode == 0, p2.stderr[-4000:]

    full = json.loads((tmp_path / "full.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert full["version"] == resumed["version"] == NUM_STEPS
    for s in range(CKPT_STEP + 1, NUM_STEPS + 1):
        assert resumed["metrics"][str(s)] == full["metrics"][str(s)], s  # exact, including lr and grad_norm
    assert full["metrics"]["3"]["train/step_skipped"] == 1.0 and full["metrics"]["4"]["train/skipped_steps"] == 1.0
    assert full["metrics"]["4"]["train/step_skipped"] == 0.0
    lrs = [full["metrics"][str(s)]["train/lr"] for s in range(1, NUM_STEPS + 1)]
    assert lrs[0] == pytest.approx(1e-3) and lrs[1] < lrs[0]  # warmup 1 step, then cosine decay
    assert full["metrics"]["2"]["train/kl"] > 0  # the reference model is in play after step 1
    w_full = torch.load(tmp_path / "full_weights.pt")
    w_res = torch.load(tmp_path / "resumed_weights.pt")
    assert all(torch.equal(w_full[k], w_res[k]) for k in w_full)
    # the checkpoint's HF export and the offline converter agree with the live weights at step 2
    w_ckpt = torch.load(tmp_path / "ckpt_weights.pt")
    exported = load_file(str(tmp_path / "ckpt" / "hf_export" / "model.safetensors"))
    converted = load_file(str(actor_checkpoint_to_hf(tmp_path / "ckpt", tmp_path / "conv") / "model.safetensors"))
    for k in w_ckpt:
        assert torch.equal(w_ckpt[k], exported[k]) and torch.equal(w_ckpt[k], converted[k]), k
    assert not torch.equal(w_ckpt["lm_head.weight"], w_full["lm_head.weight"])
    dopt = json.loads((tmp_path / "dopt.json").read_text())
    assert dopt["same"] and dopt["grad_norm"] > 0
    assert dopt["one_tokens"] > 0 and dopt["empty"] == 1.0 and dopt["empty_unchanged"]
    assert dopt["converted_exact"] and dopt["converted_step"] == 0 and dopt["version"] == 0


if __name__ == "__main__":
    main()
