"""The actor's train step with each attention backend (asyncrl.actor.layer_spec), on this machine's device.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 1 benchmarks/attention_bench.py [--repeats 3]

Builds the tiny Qwen2 checkpoint (asyncrl.models.tiny), two synthetic GRPO batches (short: prompts
32-64 + responses 64-160 tokens; long: prompts 64-128 + responses 400-900) and times
``Actor.train_step`` (gloo world of 1, TP=1, fp32 on CPU) with ``actor.attention_backend`` =
``unfused`` (Megatron's local attention, dense mask) and ``sdpa`` (per-sequence fused SDPA), in
alternation so both see the same machine load. Figures are trained tokens per second (median of
the timed steps after a warm-up), one value per round. The last stdout line is one JSON object.
``--load`` (``benchmarks/harness.py``): idle, under the fixed background load (two busy processes), or both (the
default): each condition's figures under ``idle`` / ``loaded``, the first's also at the top level (as before).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

BATCHES = {"short": ((32, 64), (64, 160), 16), "long": ((64, 128), (400, 900), 4)}  # prompt, response, groups


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per measurement")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of the backends")
    harness.add_load_arg(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with tempfile.TemporaryDirectory(prefix="attention_bench_") as d:  # removed at exit (mkdtemp left one a run)
        return _measure(args, Path(d))


def _measure(args, tmp: Path) -> int:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from asyncrl.actor.megatron_actor import Actor
    from asyncrl.actor.synthetic import synthetic_groups, tiny_actor_config
    from asyncrl.models.spec import ModelSpec
    from asyncrl.models.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp / "hf")
    vocab = ModelSpec.from_pretrained(hf).vocab_size
    dist.init_process_group("gloo")
    result: dict = {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}"
    }
    batches = {}
    for name, (plen, rlen, num_groups) in BATCHES.items():
        batches[name] = synthetic_groups(
            seed=0, num_groups=num_groups, group_size=4, vocab_size=vocab, prompt_len=plen, response_len=rlen
        )
        result[f"{name}_tokens"] = sum(len(t.prompt_ids) + len(t.response_ids) for t in _trajs(batches[name]))
    for cond in harness.conditions(args.load):
        with harness.under_condition(cond) as info:
            figures = {}
            for name, groups in batches.items():
                for _ in range(args.rounds):
                    for backend in ("unfused", "sdpa"):
                        cfg = tiny_actor_config(
                            str(hf),
                            actor={"max_tokens_per_microbatch": 4096, "attention_backend": backend},
                            runner={"max_steps": 100},
                        )
                        actor = Actor(cfg)
                        actor.train_step(groups)  # warm-up
                        times = [actor.train_step(groups)["time/training"] for _ in range(args.repeats)]
                        figures.setdefault(f"{name}_{backend}_tokens_per_s", []).append(
                            round(result[f"{name}_tokens"] / statistics.median(times))
                        )
                        ps.destroy_model_parallel()
            print(f"{cond}: {figures}", flush=True)
        result[cond] = info | figures
    first = next(c for c in ("idle", "loaded") if c in result)
    result |= {k: v for k, v in result[first].items() if k.endswith("_tokens_per_s")}  # the keys as before --load
    result["top_level_condition"] = first
    dist.destroy_process_group()
    print(json.dumps(result))
    return 0


def _trajs(groups):
    return [t for g in groups for t in g.trajectories]


if __name__ == "__main__":
    raise SystemExit(main())
