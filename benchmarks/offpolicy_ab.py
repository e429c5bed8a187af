"""Off-policy corrections A/B on the CPU default at a forced staleness: reward curves and held-out accuracy.

Runs the embedded default (``configs/tiny.toml``: 60 steps, 8 prompts x 4 samples a step) with its warm start
already prepared under ``--prep`` (made once, by the first run if absent) and staleness forced up: the buffer
limit at 4 x B (``rollout_buffer.max_buffered_groups = 32``: groups wait ~4 steps) and ``in_place`` pauses (a
trajectory spans versions). Each arm is one ``algorithm.off_policy_correction`` (plus its overrides); every arm
runs once per seed (``runner.seed``), the arms interleaved within a seed and their order rotated from one seed
to the next, so no arm always meets the same load. Per run it keeps the reward of every step, held-out accuracy
before and after (``summary.json``), staleness, the mismatch and what the correction dropped; per arm the median
and spread over seeds; per arm but the first a ratio to the first arm, paired by seed (held-out accuracy after).
The machine's load and speed are recorded around every run.

    python benchmarks/offpolicy_ab.py --arms none tis icepop --seeds 1 2 3 --save   # ~9 runs of ~2 min
    python benchmarks/offpolicy_ab.py --plot benchmarks/baselines/offpolicy_ab.json  # redraw docs/offpolicy_ab.png

``--load`` (``benchmarks/harness.py``): idle, under the fixed background load (two busy processes), or both (the
default; each condition's runs under ``idle`` / ``loaded``; ``--plot`` draws a run's idle ones). Each run's seed fixes
its data, not its schedule: the load moves the staleness each trajectory meets, so both are kept.

``--screen`` runs every correction once (one seed) to choose the mask for the A/B (say which seed; a choice made on
the A/B's own seeds would favour it). The last stdout line is the JSON (``--save``: also
``benchmarks/baselines/offpolicy_ab.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import harness  # noqa: E402

FORCED = ("rollout_buffer.max_buffered_groups=32", 'rollout.pause_mode="in_place"')
"""The forced staleness: 4 x B buffered (B = 8 groups) and trajectories that span versions."""
RUN_TIMEOUT_S = 900.0  # a 60-step run takes ~1.5-3 min on 2 loaded cores; 15 min means it hangs
KILL_GRACE_S = 10.0
ALL_CORRECTIONS = ("none", "tis", "token_mis", "seq_mis", "geo_mask", "icepop", "dppo", "m2po")
TAIL_STEPS = 10  # the reward figure of a run: its last 10 steps' mean


def overrides(prep: Path, run_dir: Path, *, seed: int, arm: str, steps: int) -> list[str]:
    """The run's ``key=value`` overrides of configs/tiny.toml (``arm``: a correction, or ``name:key=value,...``)."""
    name, _, extra = arm.partition(":")
    return [
        f'prepare.dir="{prep}"',
        f'actor.model_path="{prep}/model_sft"',
        f'data.train_path="{prep}/data/train.jsonl"',
        f'data.test_path="{prep}/data/test.jsonl"',
        f'agentloop.tool.corpus_path="{prep}/data/corpus.jsonl"',
        f'logging.run_dir="{run_dir}"',
        f"rollout.port={harness.free_rollout_port()}",
        f"runner.seed={seed}",
        f"runner.max_steps={steps}",
        *FORCED,
        f'algorithm.off_policy_correction="{name}"',
        *(kv for kv in extra.split(",") if kv),
    ]


def run_once(prep: Path, out_dir: Path, *, seed: int, arm: str, steps: int) -> dict:
    """One training run (its own process group, killed whole on timeout); its figures."""
    run_dir = out_dir / f"{arm.replace(':', '_').replace('=', '').replace(',', '_')}_seed{seed}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(harness.free_port()), "--log-dir", str(run_dir / "torchelastic"),
        str(REPO / "launch" / "train.py"), str(REPO / "configs/tiny.toml"),
        *overrides(prep, run_dir, seed=seed, arm=arm, steps=steps),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    load_before, t0 = harness.loadavg(), time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir.with_suffix(".log"), "w") as log:
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=RUN_TIMEOUT_S)
        finally:
            if p.poll() is None:  # timed out or interrupted: the whole job goes, by its process group
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=KILL_GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"run {arm} seed {seed} failed (exit {rc}); log: {run_dir.with_suffix('.log')}")
    return _figures(run_dir) | {
        "arm": arm, "seed": seed, "wall_s": wall, "load_before": load_before, "load_after": harness.loadavg(),
    }  # fmt: skip


def _figures(run_dir: Path) -> dict:
    s = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m for m in steps if "reward/mean" in m]

    def mean(key: str) -> float:
        xs = [m[key] for m in steps if key in m]
        return statistics.fmean(xs) if xs else float("nan")

    rewards = [m["reward/mean"] for m in steps]
    return {
        "heldout_before": s["test_accuracy_before"],
        "heldout_after": s["test_accuracy_after"],
        "reward_curve": rewards,
        "reward_tail": statistics.fmean(rewards[-TAIL_STEPS:]),
        "staleness_mean": s["staleness_mean"],
        "token_staleness_mean": mean("train/token_staleness/mean"),
        "logprob_mismatch": mean("train/logprob_mismatch"),
        "mismatch_kl": mean("train/mismatch_kl"),
        "is_dropped_fraction": mean("train/is_dropped_fraction"),
        "time_step_s": s["time/step"],
    }


def aggregate(runs: list[dict], arms: list[str]) -> dict:
    """Per arm: median and spread over seeds of each figure, and the median reward curve."""
    out = {}
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        figs = {
            k: harness.summary([r[k] for r in mine]) for k in ("heldout_after", "reward_tail", "is_dropped_fraction")
        }
        curves = [r["reward_curve"] for r in mine]
        n = min(len(c) for c in curves)
        figs["reward_curve_median"] = [statistics.median(c[i] for c in curves) for i in range(n)]
        out[arm] = figs
    return out


def pooled(files: list[dict]) -> dict:
    """One A/B from several runs of this benchmark, their runs together (a baselines file: each of its kept runs
    with the arms and steps of its latest, e.g. seeds 1-3 and 4-6 run apart)."""
    docs = []
    for f in files:
        last = f.get("latest", f)
        mine = [d for d in f.get("runs", [f]) if (d.get("arms"), d.get("steps")) == (last["arms"], last["steps"])]
        docs += [v for d in mine for v in _condition_views(d)]
    arms = docs[0]["arms"]
    runs = [r for d in docs for r in d["ab_runs"] if r["arm"] in arms]
    dates = sorted(d["date"] for d in docs)
    agg = aggregate(runs, arms)
    for arm in arms[1:]:
        seeds = sorted({r["seed"] for r in runs if r["arm"] == arm} & {r["seed"] for r in runs if r["arm"] == arms[0]})
        diff = [_heldout(runs, arm, s) - _heldout(runs, arms[0], s) for s in seeds]
        agg[arm][f"heldout_after_minus_{arms[0]}"] = harness.summary(diff) | {"note": "paired by seed"}
    return {"arms": arms, "ab_runs": runs, "per_arm": agg, "date": " + ".join(dates)}


def _condition_views(doc: dict) -> list[dict]:
    """A run's JSON as the A/B reads it: its ``idle`` condition's runs (a ``--load loaded`` run's ``loaded`` ones; a
    run from before ``--load``: as it is). One condition a run, so each seed pairs once."""
    for c in ("idle", "loaded"):
        if isinstance(doc.get(c), dict):
            return [harness.condition_view(doc, c)]
    return [doc]


def _heldout(runs: list[dict], arm: str, seed: int) -> float:
    return next(r["heldout_after"] for r in runs if r["arm"] == arm and r["seed"] == seed)


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = doc["arms"]
    runs = doc["ab_runs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    for k, arm in enumerate(arms):
        colour = f"C{k}"
        curves = [r["reward_curve"] for r in runs if r["arm"] == arm]
        n = min(len(c) for c in curves)
        w = 5  # a 5-step moving average: one step's reward is the mean of only 32 trajectories
        for c in curves:
            ax1.plot(_smooth(c[:n], w), color=colour, alpha=0.25, lw=1)
        med = [statistics.median(c[i] for c in curves) for i in range(n)]
        ax1.plot(_smooth(med, w), color=colour, lw=2, label=f"{arm} (median of {len(curves)} seeds)")
        acc = [r["heldout_after"] for r in runs if r["arm"] == arm]
        ax2.scatter([k] * len(acc), acc, color=colour, alpha=0.6)
        ax2.hlines(statistics.median(acc), k - 0.3, k + 0.3, color=colour, lw=2)
    before = statistics.median(r["heldout_before"] for r in runs if r["heldout_before"] is not None)
    ax2.axhline(before, color="grey", ls=":", label=f"before RL ({before:.2f})")
    ax1.set(xlabel="step", ylabel="reward (5-step moving average)", title="training reward, staleness forced to ~4")
    ax1.legend(fontsize=8)
    ax2.set(xticks=range(len(arms)), xticklabels=arms, ylabel="held-out accuracy after RL", title="per seed")
    ax2.legend(fontsize=8)
    load = [r["load_before"]["1m"] for r in runs]
    fig.suptitle(
        f"asyncrl CPU default, max_buffered_groups = 4 x B, in_place pauses; {doc['date']}, load {min(load):.1f}-"
        f"{max(load):.1f} on {runs[0]['load_before'].get('cpus')} cores",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)


def _smooth(xs: list[float], w: int) -> list[float]:
    return [statistics.fmean(xs[max(0, i - w + 1) : i + 1]) for i in range(len(xs))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", nargs="+", default=["none", "tis", "icepop"], help="corrections (name:key=value,...)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prep", type=Path, default=Path("/tmp/offpolicy_prep"), help="the prepared default (shared)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/offpolicy_runs"), help="run directories")
    ap.add_argument("--screen", action="store_true", help="every correction once, on --seeds[0]")
    ap.add_argument("--plot", type=Path, nargs="+", help="only draw the plot from these JSONs (their runs pooled)")
    ap.add_argument("--png", type=Path, default=REPO / "docs" / "offpolicy_ab.png")
    ap.add_argument("--save", action="store_true", help="also write benchmarks/baselines/offpolicy_ab.json")
    harness.add_load_arg(ap)
    a = ap.parse_args(argv)
    if a.plot:
        doc = pooled([json.loads(p.read_text()) for p in a.plot])
        plot(doc, a.png)
        print(json.dumps({"pooled": [str(p) for p in a.plot], "per_arm": doc["per_arm"]}, default=float))
        return 0
    arms, seeds = (list(ALL_CORRECTIONS), a.seeds[:1]) if a.screen else (a.arms, a.seeds)
    rep = harness.Report("offpolicy_ab", argv)
    for cond in harness.conditions(a.load):
        with rep.condition(cond):
            rep.record(_ab(rep, a, a.out / cond, arms, seeds))
    doc = rep.emit({"arms": arms, "seeds": seeds, "forced": list(FORCED), "steps": a.steps}, save=a.save)
    if not a.screen:
        plot(pooled([doc]), a.png)
    return 0


def _ab(rep, a, out_dir: Path, arms: list[str], seeds: list[int]) -> dict:
    """Every arm on every seed under the current condition; the ratios to ``rep``, the runs and per-arm figures back."""
    runs = []
    for i, seed in enumerate(seeds):
        order = arms[i % len(arms) :] + arms[: i % len(arms)]  # rotated: each arm leads once in len(arms) seeds
        for arm in order:
            r = run_once(a.prep, out_dir, seed=seed, arm=arm, steps=a.steps)
            print(
                f"{arm} seed {seed}: held-out {r['heldout_before']} -> {r['heldout_after']}, reward last "
                f"{TAIL_STEPS} {r['reward_tail']:.3f}, dropped {r['is_dropped_fraction']:.4f}, "
                f"{r['wall_s']:.0f} s at load {r['load_before']['1m']:.1f}",
                flush=True,
            )
            runs.append(r)
    agg = aggregate(runs, arms)
    base = arms[0]
    for arm in arms[1:]:
        num = [r["heldout_after"] for s in seeds for r in runs if r["arm"] == arm and r["seed"] == s]
        den = [r["heldout_after"] for s in seeds for r in runs if r["arm"] == base and r["seed"] == s]
        agg[arm]["heldout_after_minus_" + base] = harness.summary([x - y for x, y in zip(num, den)]) | {
            "note": "paired by seed"
        }
        if min(den) <= 0:
            print(f"heldout_{arm}_over_{base}: no ratio ({base} reached 0 on a seed); see the difference", flush=True)
            continue
        rep.ratio(
            f"heldout_{arm.split(':')[0]}_over_{base}_ratio",
            num,
            den,
            target=1.0,
            note=f"held-out accuracy after RL, {arm} / {base}, paired by seed (>= 1: no worse)",
        )
    return {"per_arm": agg, "ab_runs": runs}


if __name__ == "__main__":
    sys.exit(main())
