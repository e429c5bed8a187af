"""Sync vs async on the embedded default: how much of the step the overlap of generation and training saves.

Runs the embedded default (``configs/tiny.toml``: one Megatron actor rank + the broker, one rollout
rank with the CPU engine and the agent worker) under ``torchrun --nproc_per_node 2`` twice, back to
back, on the same prepared tiny model and data, with the same config except ``runner.async_mode``:

  * sync:  generation and training take turns: time/step = time/rollout + time/training + time/sync_weights
  * async: the engine keeps generating while the actor trains: time/step = time/wait_data +
           time/training + time/sync_weights

and reports, from each run's ``metrics.jsonl``:
  * time/step of each (mean over the steps after the first) and their ratio sync/async (target >= 1.5,
    the RLinf reference halves the step: 278.6 s -> 139.0 s), plus the same over the second half
    of the steps (``steady``: the async run's start-up head start - groups generated while the
    actor was still loading - is used up by then);
  * the same from the wall clock between the first and last step's records (``sync_over_async_wall``:
    counts the per-step logging and the engines' /metrics scrape, which time/step leaves out);
  * the time/step split of each;
  * the overlap efficiency = ideal / measured async time/step, ideal = max(generation, training) +
    sync, with generation, training and sync each measured alone in the sync run (time/rollout,
    time/training, time/sync_weights). 1.0 = a perfect overlap. It can exceed 1: sync-mode
    time/rollout holds the batch's tail (the engine runs under-filled while the last trajectories
    finish), which async generation does not pay; and the async run's head start.
The ratio is limited by what the two modes cannot share: the per-step weight sync (longer in async:
the engine is paused mid-generation), and CPU contention - the rollout side is the engine plus the
agent worker and the broker, the actor needs its core at the same time, and other jobs on the
machine take their share (the async run needs two cores at once, the sync run one).

The two ranks get one core each (torchrun sets OMP_NUM_THREADS=1, the CPU engine runs single
threaded), so the overlap is real parallelism. On a shared machine the figures vary by +-0.3 from
run to run: every mode runs 5 paired runs (``--reps``, at least 3), sync/async interleaved with the order
alternating (``benchmarks/harness.py``), and the ratios are taken per pair (median and spread):
``sync_over_async_ratio`` (target >= 1.5) and ``overlap_efficiency_ratio`` (target >= 0.9). The
pause mode is the default ``retract``.

    python benchmarks/overlap.py --quick          # 12 steps per run, 5 rounds of 3 runs: ~5-6 min a condition
    python benchmarks/overlap.py                  # 20 steps per run, 3 pairs
    python benchmarks/overlap.py --quick --save   # also write benchmarks/baselines/overlap.json
    python benchmarks/overlap.py --quick --workload long_tail   # generation-bound with a long tail (RLinf's regime)

A third side, ``sync_both_cores``, is the honest baseline (issue 45): a sync run in which every process has both
cores' threads (``--sync-threads``, default 2), so the part that runs alone (the engine generating, then the actor
training) uses the core the turn-taking would leave idle. How: the job's ``OMP_NUM_THREADS`` (the torchrun ranks:
the actor's torch threads) and ``ASYNCRL_CPU_ENGINE_NUM_THREADS`` (``asyncrl.cpu_engine.args.NUM_THREADS_ENV``: the
CPU engine's ``--num-threads``, which the launcher leaves out, starting it with ``OMP_NUM_THREADS=1``) both set to
it (``harness.run_tiny_job(threads=...)``), with ``OMP_WAIT_POLICY=PASSIVE`` (without it two spinning threads a
process slowed the engine 40-fold on the shared 2 cores: ``harness.OMP_WAIT_POLICY_NOTE``).
``both_cores_sync_over_async_ratio`` = its time/step / async's, per round (target >= 1.0: the overlap must beat a
sync run that leaves no core idle), and ``best_sync_over_async_ratio`` the faster of the round's two sync runs /
async (the baseline a user would pick: where other jobs hold a core, two threads a process can run slower than one,
OpenMP's barriers waiting on a preempted thread); ``second_core_speedup`` says what the second core's threads bought
each part (one-core s / both-cores s; below 1: they cost). The three sides run interleaved, the order alternating;
``sync_over_async_ratio`` and ``overlap_efficiency_ratio`` keep their meaning (the one-core sync run).

Every mode runs idle and under the harness's fixed background load (``--load``; both by default, under ``idle``
and ``loaded`` in the JSON): twice the time above (and the third side adds half again); ``--load idle`` for one.

The tiny model and data are prepared once under ``--prep-dir`` (default runs/overlap_bench,
a short warm start; the first run pays ~1-3 min for it, not counted in the figures).
The last stdout line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import harness  # noqa: E402

# The workload: chosen so that one batch's generation (time/rollout) and its training
# (time/training) take comparable time on one core each, which is where overlapping them pays most.
# Measured 2026-12-03 on 2 idle AMD EPYC cores: with the tiny default's 24 tokens a turn, generation
# 0.28 s and training 0.38 s a step (ideal ratio ~1.7); with 16 tokens a turn (this benchmark's
# earlier setting, balanced for the slower engine of 2026-12-01) generation had dropped to 0.18 s
# against 0.29 s of training (ideal ~1.5: the benchmark could not show the overlap any more).
BALANCED = [
    "data.rollout_batch_size=4",
    "algorithm.group_size=2",
    "rollout.sampling.temperature=1.0",
    "rollout.update_weights_interval=1",
    # rollout.pause_mode stays the default ``retract`` (the headline measures the default): every
    # sync retracts the running requests and their prefill is redone after it, which the async run
    # pays and the sync run (nothing in flight at a sync) does not. ``--set rollout.pause_mode=
    # "in_place"`` measures the cheaper mode.
    "runner.eval_before_after=false",
    "actor.lr_warmup_steps=0",
]
# Issue 45: the balanced workload flatters the overlap (it was chosen where overlapping pays most). RLinf's regime
# is generation-bound with a long tail: a bigger batch, turns up to 4x longer (the tiny model at temperature 1.0
# stops some turns at once and runs others to the cap, so a batch waits on its longest trajectories).
LONG_TAIL = [
    *(x for x in BALANCED if not x.startswith(("data.rollout_batch_size", "algorithm.group_size"))),
    "data.rollout_batch_size=8",
    "algorithm.group_size=2",
    "agentloop.max_tokens_per_turn=96",
    "agentloop.max_total_tokens=640",
]
WORKLOADS = {"balanced": BALANCED, "long_tail": LONG_TAIL}
# The preparation: a short warm start (the benchmark measures time, not learning).
PREPARE = ["prepare.sft_steps=20", "prepare.num_entities=60"]
RUN_TIMEOUT_S = 600.0  # one torchrun job; a hang fails the benchmark instead of blocking forever


def prepare(prep_dir: Path) -> float:
    from asyncrl.config import load_config
    from asyncrl.runner.prepare import prepare_if_needed

    t0 = time.perf_counter()
    cfg = load_config(REPO / "configs/tiny.toml", [f'prepare.dir="{prep_dir}"', *PREPARE])
    prepare_if_needed(cfg)
    return time.perf_counter() - t0


def job_overrides(
    prep_dir: Path, run_dir: Path, *, async_mode: bool, steps: int, extra: list[str], workload: str = "balanced"
) -> list[str]:
    return [
        *harness.tiny_overrides(prep_dir, run_dir, steps=steps),
        *PREPARE,  # the artefacts' recipe: the job's preparation finds them made by it
        *WORKLOADS[workload],
        *extra,
        f"runner.async_mode={'true' if async_mode else 'false'}",
    ]


def run_job(
    prep_dir: Path,
    run_dir: Path,
    *,
    async_mode: bool,
    steps: int,
    extra: list[str],
    workload: str = "balanced",
    threads: int = 1,
) -> dict:
    """One torchrun job to its end; ``threads``: torch threads of every process, the CPU engine's included
    (``harness.run_tiny_job``)."""
    overrides = job_overrides(prep_dir, run_dir, async_mode=async_mode, steps=steps, extra=extra, workload=workload)
    what = f"overlap: the {'async' if async_mode else 'sync'} job ({threads} thread(s) a process)"
    wall_s, recs = harness.run_tiny_job(run_dir, overrides, timeout_s=RUN_TIMEOUT_S, what=what, threads=threads)
    return {"wall_s": wall_s, "records": recs}


SIDES = {"sync": (False, 1), "sync_both_cores": (False, 0), "async": (True, 1)}
"""Each side: (async mode, threads a process; 0: ``--sync-threads``). ``sync`` takes turns on one core at a time
(the overlap's ideal comes from it: each part on the one core async gives it); ``sync_both_cores`` takes turns with
every process on both cores' threads (the honest baseline: a sync run that leaves no core idle while one part runs);
``async`` runs the parts at once, one core each."""
SPLIT = {
    "sync": ("time/rollout", "time/training", "time/sync_weights"),
    "sync_both_cores": ("time/rollout", "time/training", "time/sync_weights"),
    "async": ("time/wait_data", "time/training", "time/sync_weights"),
}


def _mean(recs: list[dict], key: str) -> float:
    vals = [r[key] for r in recs if r.get(key) is not None]
    return statistics.mean(vals) if vals else 0.0


def summarize(mode: str, runs: list[dict]) -> dict:
    """Figures of one mode over its repeats: the steps after the first of every run, and their second half."""
    after_first = [rec for run in runs for rec in run["records"][1:]]
    steady = [rec for run in runs for rec in run["records"][len(run["records"]) // 2 :]]
    # wall clock between the ends of the first and the last step (includes the per-step logging and
    # /metrics scrape that time/step leaves out)
    wall = [
        (run["records"][-1]["time"] - run["records"][0]["time"]) / (len(run["records"]) - 1)
        for run in runs
        if len(run["records"]) > 1
    ]
    out = {
        "time_step_s": _mean(after_first, "time/step"),
        "wall_step_s": statistics.mean(wall) if wall else 0.0,
        "time_step_steady_s": _mean(steady, "time/step"),
        "split_s": {k: _mean(after_first, k) for k in SPLIT[mode]},
        "steps_per_run": [len(run["records"]) for run in runs],
        "job_wall_s": [round(run["wall_s"], 1) for run in runs],
        "response_length_mean": _mean(after_first, "rollout/response_length/mean"),
        "generated_tokens_mean": _mean(after_first, "rollout/generated_tokens/mean"),
        "turns_mean": _mean(after_first, "rollout/turns/mean"),
        "staleness_mean": _mean(after_first, "rollout/data_staleness/mean"),
        "staleness_max": max((r.get("rollout/data_staleness/max", 0.0) for r in after_first), default=0.0),
    }
    return out


def figures(sync: dict, asyn: dict) -> dict:
    gen = sync["split_s"]["time/rollout"]
    train = sync["split_s"]["time/training"]
    sync_w = sync["split_s"]["time/sync_weights"]
    ideal = max(gen, train) + sync_w
    return {
        "sync_time_step_s": sync["time_step_s"],
        "async_time_step_s": asyn["time_step_s"],
        "sync_over_async": sync["time_step_s"] / asyn["time_step_s"],
        "sync_over_async_steady": sync["time_step_steady_s"] / asyn["time_step_steady_s"],
        "sync_over_async_wall": sync["wall_step_s"] / asyn["wall_step_s"],
        "ideal_async_time_step_s": ideal,
        "ideal_sync_over_async": sync["time_step_s"] / ideal,
        "overlap_efficiency": ideal / asyn["time_step_s"],
    }


def _round(x):
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_round(v) for v in x]
    return x


def _one_condition(rep, prep_dir: Path, *, steps: int, args) -> dict:
    """``args.reps`` rounds of runs (``SIDES``: sync, sync on both cores, async) under the current condition; ratios
    to ``rep``; figures back."""
    runs: dict[str, list[dict]] = {mode: [] for mode in SIDES}
    with tempfile.TemporaryDirectory(prefix="overlap_") as tmp:

        def one(mode: str) -> float:
            i = len(runs[mode])
            async_mode, threads = SIDES[mode]
            res = run_job(
                prep_dir,
                Path(tmp) / f"{mode}{i}",
                async_mode=async_mode,
                steps=steps,
                extra=args.extra,
                workload=args.workload,
                threads=threads or args.sync_threads,
            )
            runs[mode].append(res)
            s = summarize(mode, [res])
            print(
                f"{mode} run {i}: time/step {s['time_step_s']:.3f}s (steady {s['time_step_steady_s']:.3f}s) "
                f"split {json.dumps(_round(s['split_s']))} job {res['wall_s']:.1f}s",
                flush=True,
            )
            return s["time_step_s"]

        t = harness.interleave({m: lambda m=m: one(m) for m in SIDES}, reps=args.reps, warmup=0)
    pairs = [figures(summarize("sync", [s]), summarize("async", [x])) for s, x in zip(runs["sync"], runs["async"])]
    both = [summarize("sync_both_cores", [r]) for r in runs["sync_both_cores"]]
    one_core = [summarize("sync", [r]) for r in runs["sync"]]
    rep.ratio(
        "both_cores_sync_over_async_ratio",
        t["sync_both_cores"],
        t["async"],
        target=1.0,
        note=f"time/step of a sync run whose every process has {args.sync_threads} threads (the CPU engine's too) / "
        "async time/step, per round: the overlap against a sync baseline that leaves no core idle",
    )
    rep.ratio(
        "best_sync_over_async_ratio",
        [min(a, b) for a, b in zip(t["sync"], t["sync_both_cores"])],
        t["async"],
        target=1.0,
        note="the faster sync run of the round (one core or both cores' threads) / async time/step: on a shared "
        "machine more threads than free cores can be slower than one (OpenMP barriers wait on preempted threads)",
    )
    rep.ratio(
        "sync_over_async_ratio",
        t["sync"],
        t["async"],
        target=1.5,
        note="sync-mode time/step / async-mode time/step, per pair of runs",
    )
    rep.ratio(
        "overlap_efficiency_ratio",
        [f["ideal_async_time_step_s"] for f in pairs],
        t["async"],
        target=0.9,
        note="ideal / measured async time/step, ideal = max(generation, training) + sync of the pair's sync run",
    )
    return {
        "pairs": _round(pairs),
        "sync": _round(summarize("sync", runs["sync"])),
        "sync_both_cores": _round(summarize("sync_both_cores", runs["sync_both_cores"]))
        | {"threads": args.sync_threads},
        "async": _round(summarize("async", runs["async"])),
        "second_core_speedup": _round(
            {  # what the sync baseline gains from the second core's threads, per part (one-core s / both-cores s)
                k: statistics.median(a["split_s"][k] / b["split_s"][k] for a, b in zip(one_core, both))
                for k in SPLIT["sync"]
                if all(b["split_s"][k] > 0 for b in both)
            }
        ),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_args(p, reps=5, load=True)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="balanced", help="WORKLOADS (module docstring)")
    p.add_argument("--steps", type=int, help="steps per run (default 12 quick, 20 full)")
    p.add_argument(
        "--sync-threads",
        type=int,
        default=2,
        help="torch threads of every process of the both-cores sync run (default 2: the two cores the baselines use)",
    )
    p.add_argument("--prep-dir", default=str(REPO / "runs/overlap_bench"), help="prepared tiny model and data (cached)")
    p.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override for both modes (repeatable)",
    )
    a = p.parse_args(argv)
    if a.reps < 3:
        raise SystemExit(f"--reps {a.reps}: at least 3 paired runs (one pair is noise on a shared machine)")
    if a.sync_threads < 2:
        raise SystemExit(f"--sync-threads {a.sync_threads}: at least 2 (the both-cores baseline; 1 is the sync side)")
    rep = harness.Report("overlap", argv)
    steps = a.steps or (12 if a.quick else 20)
    prep_dir = Path(a.prep_dir).resolve()
    prep_s = prepare(prep_dir)
    for cond in harness.conditions(a.load):
        with rep.condition(cond):
            rep.record(_one_condition(rep, prep_dir, steps=steps, args=a))
    result = {
        "steps": steps,
        "paired_runs": a.reps,
        "workload": a.workload,
        "overrides": WORKLOADS[a.workload] + a.extra,
        "prepare": PREPARE,
        "prepare_s": prep_s,
    }
    rep.emit(result, save=a.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
