"""Actor training throughput: the Megatron actor vs the same step in plain PyTorch, same token budget.

    python benchmarks/actor_bench.py [--quick]

Builds the tiny Qwen2 checkpoint (asyncrl.models.tiny), a synthetic GRPO batch, and times
``Actor.train_step`` (1 process, gloo world of 1, TP=1, fp32 on CPU) at two micro-batch token
budgets; then the same step written as plain PyTorch: the HF transformers model, the SAME
micro-batches (``make_microbatches`` under the same token budget), the same ``policy_loss`` with
entropy, grad clipping at 1.0, torch AdamW with the actor's lr/eps. The two run interleaved, ``--reps``
times each (``benchmarks/harness.py``); the ratio is plain seconds / actor seconds per repetition
(target >= 1.0). Figures are trained tokens (prompt + response, padding excluded) per second.

Fair both ways: the actor packs each micro-batch (no padding) and takes log-probs of response
positions only; the plain loop right-pads each micro-batch (it computes ``padded_tokens``, printed,
and the ratio to the real tokens) - the natural plain-PyTorch layout on CPU, where HF has no packed
attention - but also takes the log-softmax of response positions only (not of every row of the
logits), so it does no more loss-side work than the actor. Neither side runs a reference model or a
separate old-log-prob pass (the rollout log-prob is the old log-prob). The last stdout line is one
JSON object.

A second baseline (issue 45): the same plain loop with the batch sorted by length before it is cut into
micro-batches (``plain_sorted``), so rows of like length share a micro-batch and little is padded: the actor's
lead over the unsorted loop at a small budget is mostly that padding, and the sorted loop shows how much is
left (``budget*_actor_over_sorted_ratio``). Everything runs idle and under the harness's fixed background load
(``--load``; both by default, under ``idle`` and ``loaded`` in the JSON).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

from asyncrl.cluster.ports import free_port


def length_sorted(samples: list) -> list:
    """The samples shortest first (stable): micro-batches cut from it pad little."""
    return sorted(samples, key=lambda s: s.num_tokens)


def padded_tokens(samples: list, budget: int) -> int:
    """Tokens the plain loop computes (each micro-batch right-padded to its longest row)."""
    from asyncrl.actor.batch import make_microbatches

    return sum(
        len(idx) * max(samples[i].num_tokens for i in idx)
        for idx in make_microbatches([s.num_tokens for s in samples], budget)
    )


def plain_pytorch_step(model, opt, samples, budget: int, algo) -> float:
    """One GRPO step as plain PyTorch on the HF model; returns seconds."""
    from asyncrl.actor.batch import make_microbatches
    from asyncrl.actor.loss import policy_loss

    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    for idx in make_microbatches([s.num_tokens for s in samples], budget):
        mb = [samples[i] for i in idx]
        L = max(s.num_tokens for s in mb)
        ids = torch.zeros(len(mb), L, dtype=torch.long)
        att = torch.zeros(len(mb), L, dtype=torch.long)
        for r, s in enumerate(mb):
            ids[r, : s.num_tokens] = s.tokens
            att[r, : s.num_tokens] = 1
        logits = model(input_ids=ids, attention_mask=att).logits
        lp, ent, behav, adv, w, m = [], [], [], [], [], []
        for r, s in enumerate(mb):
            rows = torch.log_softmax(logits[r, s.prompt_len - 1 : s.num_tokens - 1].float(), -1)
            tgt = s.tokens[s.prompt_len :]
            lp.append(rows.gather(-1, tgt.unsqueeze(-1)).squeeze(-1))
            ent.append(-(rows.exp() * rows).sum(-1))
            behav.append(s.rollout_logprobs)
            adv.append(torch.full((s.response_len,), s.advantage))
            w.append(s.agg_weight.float())
            m.append(s.loss_mask)
        out = policy_loss(
            torch.cat(lp),
            behav_logp=torch.cat(behav),
            prox_logp=None,
            advantages=torch.cat(adv),
            agg_weight=torch.cat(w),
            mask=torch.cat(m),
            clip_ratio_low=algo.clip_ratio_low,
            clip_ratio_high=algo.clip_ratio_high,
            entropy=torch.cat(ent),
        )
        out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_args(ap, load=True)
    args = ap.parse_args(argv)
    rep = harness.Report("actor_bench", argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    import torch.distributed as dist

    from asyncrl.actor.batch import groups_to_samples
    from asyncrl.actor.synthetic import synthetic_groups
    from asyncrl.models.spec import load_hf_config
    from asyncrl.models.tiny import make_tiny_checkpoint

    num_groups = 8 if args.quick else 32
    budgets = (1024, 4096)
    tmpdir = tempfile.TemporaryDirectory(prefix="actor_bench_")  # removed at exit, failed or not
    tmp = tmpdir.name
    hf = make_tiny_checkpoint(Path(tmp) / "hf")
    hf_cfg = load_hf_config(hf)
    groups = synthetic_groups(
        seed=0,
        num_groups=num_groups,
        group_size=4,
        vocab_size=hf_cfg["vocab_size"],
        prompt_len=(32, 64),
        response_len=(64, 160),
    )
    num_tokens = sum(len(t.prompt_ids) + len(t.response_ids) for g in groups for t in g.trajectories)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)

    figures: dict[str, object] = {
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "model": {k: hf_cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")},
        "batch_sequences": num_groups * 4,
        "batch_tokens": num_tokens,
        "reps": args.reps,
    }
    samples = groups_to_samples(groups, normalize_adv_by_std=True, loss_agg_mode="token_mean")

    for cond in harness.conditions(args.load):
        with rep.condition(cond):
            rep.record(_one_condition(rep, hf=hf, groups=groups, samples=samples, budgets=budgets, args=args))
    dist.destroy_process_group()
    rep.emit(figures, save=args.save)
    return 0


def _one_condition(rep, *, hf, groups, samples, budgets, args) -> dict:
    """Both budgets under the current condition: actor, plain and length-sorted plain, interleaved."""
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from asyncrl.actor.megatron_actor import Actor
    from asyncrl.actor.synthetic import tiny_actor_config

    num_tokens = sum(s.num_tokens for s in samples)
    by_length = length_sorted(samples)
    figures: dict[str, object] = {}
    for budget in budgets:
        cfg = tiny_actor_config(str(hf), actor={"max_tokens_per_microbatch": budget}, runner={"max_steps": 100})
        actor = Actor(cfg)
        models = [AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32) for _ in range(2)]
        opts = [
            torch.optim.AdamW(m.parameters(), lr=cfg.actor.lr, eps=cfg.actor.adam_eps, weight_decay=0.0) for m in models
        ]
        algo = cfg.algorithm
        t = harness.interleave(
            {
                "actor": lambda a=actor: a.train_step(groups)["time/training"],
                "plain": lambda b=budget, m=models[0], o=opts[0], c=algo: plain_pytorch_step(m, o, samples, b, c),
                "plain_sorted": lambda b=budget, m=models[1], o=opts[1], c=algo: plain_pytorch_step(
                    m, o, by_length, b, c
                ),
            },
            reps=args.reps,
            warmup=1,
        )
        ps.destroy_model_parallel()
        for side, note in (("plain", "same micro-batches"), ("sorted", "the batch sorted by length first")):
            rep.ratio(
                f"budget{budget}_actor_over_{side}_ratio",
                t["plain" if side == "plain" else "plain_sorted"],
                t["actor"],
                target=1.0,
                note=f"plain PyTorch s / Megatron actor s per step, {note}",
            )
        figures[f"budget{budget}"] = {
            **{f"{k}_s": harness.summary(v) for k, v in t.items()},
            **{f"{k}_tokens_per_s": num_tokens / statistics.median(v) for k, v in t.items()},
            "plain_padded_tokens": padded_tokens(samples, budget),
            "plain_padded_over_real": padded_tokens(samples, budget) / num_tokens,
            "plain_sorted_padded_over_real": padded_tokens(by_length, budget) / num_tokens,
        }
    return figures


if __name__ == "__main__":
    raise SystemExit(main())
