"""``max_inflight_groups = "auto"`` against fixed limits, in the simulator on both regimes (and on real processes).

The simulator (``asyncrl.simulate``: the real broker core, simulated engines, trajectories and trainer) runs
each setting of a case - fixed limits (the derived one x 1/4, 1/2, 1, 2, within the buffer bound) and auto -
once per repetition, interleaved (the order alternates from one repetition to the next), repetition ``i`` at
seed ``i`` for every setting (the repetitions pair up). Two cases:

- ``searchr1``: training-bound, Search-R1's config as the sizing tool reads it
  (``python -m asyncrl.simulate configs/searchr1.toml --engine-tok-s 2000 --train-s 85``);
- ``knee``: generation-bound, engines with a knee (the curve is flat past ~8 running requests, the slots
  fill at 32 and more queue), a fast trainer and a buffer with room for twice the derived limit.

The goal, per case (medians over the repetitions): auto's throughput >= 97% of the best fixed limit's, at a
staleness no higher than that of the smallest fixed limit reaching 97% of it, + 0.05. The machine's load
(``/proc/loadavg``) is recorded at the start, the end and per run; the simulated figures do not depend on it
(the clock is simulated), the wall seconds do.

``--real`` instead runs the CPU default (``configs/tiny.toml`` under torchrun, one engine) with ``"auto"``, the
derived limit and twice it, interleaved and repeated, and reports step time, the actor's wait for data and
staleness from each run's ``metrics.jsonl`` (minutes a run; not part of the simulator's verdict).

    python benchmarks/autotune.py --quick              # 2 repetitions (~1 min); the smoke test runs this
    python benchmarks/autotune.py --reps 5 --save      # the figures (<= 5 min idle); appended to baselines/autotune.json
    python benchmarks/autotune.py --real --reps 2 --steps 8

``--load`` (``benchmarks/harness.py``): idle, under the fixed background load (two busy processes), or both (the
default; each condition's cases and ratios under ``idle`` and ``loaded`` in the JSON). The simulated figures are the
same in both (the clock is simulated: a check that the load does not leak in); ``--real``'s are not.

The last stdout line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import harness  # noqa: E402

from asyncrl.simulate import EngineArgs, EngineModel, SimConfig, Workload, from_config, simulate  # noqa: E402

GOAL_THROUGHPUT = 0.97  # auto's throughput against the best fixed limit's (the bar)
GOAL_STALENESS = 0.05  # auto's staleness above that of the smallest fixed limit reaching the bar, at most
STEPS, MEASURE_FROM = 24, 10  # the sizing tool's run: measured after the settling deadline
PREPARE = ["prepare.sft_steps=10", "prepare.num_entities=60"]  # --real: a short warm start (this measures limits)
RUN_TIMEOUT_S = 600.0  # --real: one torchrun job; a hang fails the benchmark instead of blocking forever


def cases() -> dict[str, tuple[SimConfig, Workload]]:
    sr1, wl = from_config(
        str(REPO / "configs" / "searchr1.toml"),
        [],
        engine=EngineArgs(peak_tok_s=2000.0),
        train_s=85.0,
        mean_turn_tokens=250.0,
        tool_s=0.5,
        sync_s=0.2,
        steps=STEPS,
    )
    knee = SimConfig(
        engines=8, batch=32, engine=EngineModel(peak_tok_s=4000.0, c_half=1.0, max_running=32), steps=STEPS
    )
    knee = replace(knee, buffered=2 * knee.derived_inflight() + knee.batch)
    return {
        "searchr1": (replace(sr1, measure_from=MEASURE_FROM), replace(wl, name="searchr1 training-bound")),
        "knee": (
            replace(knee, measure_from=MEASURE_FROM),
            Workload("generation-bound with a knee", max_turns=2, train_s=0.1, sync_s=0.05),
        ),
    }


def settings(cfg: SimConfig) -> list[str]:
    """The fixed limits (derived x 1/4 .. 2, within the buffer bound), auto from the derived limit (as a run starts)
    and auto from the bound (an oversized start: what it does from above)."""
    d, bound = cfg.derived_inflight(), max(1, cfg.resolved_buffered() - cfg.batch)
    fixed = sorted({max(1, min(bound, round(d * f))) for f in (0.25, 0.5, 1.0, 2.0)})
    return [str(n) for n in fixed] + ["auto"] + ([f"auto@{bound}"] if bound > min(d, bound) else [])


def run_one(cfg: SimConfig, wl: Workload, setting: str, seed: int) -> dict:
    auto, _, start = setting.partition("@")
    if auto == "auto":
        cfg = replace(cfg, inflight="auto", auto_start=int(start) if start else None)
    else:
        cfg = replace(cfg, inflight=int(setting))
    t0 = time.perf_counter()
    r = simulate(replace(cfg, seed=seed), wl)
    k = cfg.measure_from
    return {
        "groups_s": r.throughput_groups_s(k),
        "staleness": r.mean_staleness(k),
        "wall_s": time.perf_counter() - t0,
        "load_1m": harness.loadavg()["1m"],
        "limits": r.limits,
        "training_bound": statistics.fmean(m.get("rollout/buffer/training_bound", 0.0) for m in r.metrics[k:]),
    }


def run_case(name: str, reps: int) -> dict:
    """Every setting once per repetition, interleaved; medians, spreads and the verdict for each auto setting."""
    cfg, wl = cases()[name]
    names = settings(cfg)
    runs: dict[str, list[dict]] = {s: [] for s in names}
    for i in range(reps):
        for s in names if i % 2 == 0 else names[::-1]:
            runs[s].append(run_one(cfg, wl, s, seed=i))
    rows = {
        k: {
            "groups_s": harness.summary([r["groups_s"] for r in v]),
            "staleness": harness.summary([r["staleness"] for r in v]),
            "wall_s": harness.summary([r["wall_s"] for r in v]),
            "load_1m": [r["load_1m"] for r in v],
            "training_bound_share": statistics.fmean(r["training_bound"] for r in v),
        }
        for k, v in runs.items()
    }
    fixed = [k for k in names if not k.startswith("auto")]
    med = {k: rows[k]["groups_s"]["median"] for k in rows}
    best = max(fixed, key=lambda k: med[k])
    reaching = min((k for k in fixed if med[k] >= GOAL_THROUGHPUT * med[best]), key=int)
    bar = rows[reaching]["staleness"]["median"] + GOAL_STALENESS
    autos = {
        k: {
            "throughput_ratio": med[k] / med[best],
            "staleness": rows[k]["staleness"]["median"],
            "ok": med[k] >= GOAL_THROUGHPUT * med[best] and rows[k]["staleness"]["median"] <= bar,
            "limits_per_rep": [r["limits"] for r in runs[k]],
        }
        for k in names
        if k.startswith("auto")
    }
    out = {
        "workload": wl.name,
        "engines": cfg.engines,
        "batch": cfg.batch,
        "group_size": cfg.group_size,
        "max_buffered_groups": cfg.resolved_buffered(),
        "derived": cfg.derived_inflight(),
        "settings": rows,
        "best_fixed": int(best),
        "smallest_fixed_reaching_97": int(reaching),
        "staleness_bar": bar,
        "auto": autos,
        "ok": all(a["ok"] for a in autos.values()),
        "_pairs": {k: ([r["groups_s"] for r in runs[k]], [r["groups_s"] for r in runs[best]]) for k in autos},
    }
    print(
        f"== {name}: {wl.name}, {cfg.engines} engines, batch {cfg.batch} x {cfg.group_size}, derived {out['derived']}"
    )
    for k, row in rows.items():
        g, st = row["groups_s"], row["staleness"]
        print(
            f"  {k:>8}: {harness.fmt(g, ' groups/s')}; staleness median {st['median']:.3f} "
            f"({st['min']:.3f}..{st['max']:.3f}); training-bound {row['training_bound_share']:.0%} of steps"
        )
    for k, a in autos.items():
        print(
            f"  {k}: {a['throughput_ratio']:.1%} of the best fixed ({best}); staleness {a['staleness']:.3f} <= "
            f"{bar:.3f} (fixed {reaching} + {GOAL_STALENESS}): {'ok' if a['ok'] else 'NOT MET'}; limits of rep 0: "
            f"{a['limits_per_rep'][0]}",
            flush=True,
        )
    return out


def simulated(argv: list[str], reps: int, save: bool, load: str) -> int:
    rep = harness.Report("autotune", argv)
    for cond in harness.conditions(load):
        with rep.condition(cond):
            t0 = time.perf_counter()
            figures = {}
            for name in cases():
                c = run_case(name, reps)
                for k, (auto_g, best_g) in c.pop("_pairs").items():
                    key = f"{name}_{k.replace('@', '_from_')}_throughput_ratio"
                    rep.ratio(key, auto_g, best_g, target=GOAL_THROUGHPUT, note=f"{k} / best fixed, per repetition")
                figures[name] = c
            ok = all(c["ok"] for c in figures.values())
            rep.record({"cases": figures, "all_ok": ok, "cases_wall_s": time.perf_counter() - t0})
    doc = rep.emit({"reps": reps, "order": "interleaved, alternating; rep i: seed i"})
    if save:
        _save(doc)
    return 0  # the verdict is in the JSON (all_ok, targets_missed), as in every benchmark here


def _save(doc: dict) -> None:
    """Append to ``benchmarks/baselines/autotune.json``'s runs (earlier entries kept: their own notes say what)."""
    path = harness.BASELINES / "autotune.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    runs = old.get("runs", []) + [{"command": doc["command"], "date": doc["date"], "figures": doc}]
    path.write_text(json.dumps({**old, "runs": runs}, indent=1, default=float) + "\n")


# --------------------------------------------------------------------- --real: the CPU default
def _prepare(prep_dir: Path) -> int:
    """Prepare the tiny model and data; return the derived max_inflight_groups."""
    from asyncrl.broker.core import CoreSettings
    from asyncrl.config import load_config
    from asyncrl.runner.prepare import prepare_if_needed

    cfg = load_config(REPO / "configs/tiny.toml", [f'prepare.dir="{prep_dir}"', *PREPARE])
    prepare_if_needed(cfg)
    return CoreSettings.from_config(cfg).max_inflight_groups


def _real_run(prep_dir: Path, run_dir: Path, inflight: str, steps: int) -> dict:
    overrides = [
        *harness.tiny_overrides(prep_dir, run_dir, steps=steps),
        *PREPARE,
        "runner.eval_before_after=false",
        f"rollout_buffer.max_inflight_groups={inflight}",
    ]
    what = f"autotune: the run with max_inflight_groups={inflight}"
    recs = harness.run_tiny_job(run_dir, overrides, timeout_s=RUN_TIMEOUT_S, what=what)[1][1:]  # after step 1

    def mean(key: str) -> float:
        vals = [r[key] for r in recs if r.get(key) is not None]
        return statistics.fmean(vals) if vals else 0.0

    return {
        "time_step_s": mean("time/step"),
        "wait_data_s": mean("time/wait_data"),
        "staleness_mean": mean("rollout/data_staleness/mean"),
        "training_bound": mean("rollout/buffer/training_bound"),
        "limits": [r.get("rollout/buffer/inflight_limit") for r in recs],
        "load_1m": harness.loadavg()["1m"],
    }


def real(argv: list[str], reps: int, steps: int, prep: str | None, save: bool, load: str) -> int:
    rep = harness.Report("autotune", argv)
    with tempfile.TemporaryDirectory(prefix="autotune_") as tmp:
        prep_dir = Path(prep).resolve() if prep else Path(tmp) / "prep"
        d = _prepare(prep_dir)
        for cond in harness.conditions(load):
            with rep.condition(cond):
                rep.record({"real": _real_condition(rep, prep_dir, Path(tmp) / cond, d, reps=reps, steps=steps)})
    doc = rep.emit({})
    if save:
        _save(doc)
    return 0


def _real_condition(rep, prep_dir: Path, tmp: Path, d: int, *, reps: int, steps: int) -> dict:
    """The three settings' runs under the current condition, interleaved; the ratio to ``rep``, the figures back."""
    sides = {"auto": '"auto"', f"derived={d}": str(d), f"2x={2 * d}": str(2 * d)}
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    for i in range(reps):
        for k in list(sides) if i % 2 == 0 else list(sides)[::-1]:
            runs[k].append(_real_run(prep_dir, tmp / f"{k.split('=')[0]}_{i}", sides[k], steps))
            r = runs[k][-1]
            print(f"  rep {i} {k:>10}: step {r['time_step_s']:.2f}s wait {r['wait_data_s']:.2f}s limits {r['limits']}")
    step = {k: [r["time_step_s"] for r in v] for k, v in runs.items()}
    rep.ratio("real_step_time_ratio", step["auto"], step[f"derived={d}"], target=1 / GOAL_THROUGHPUT, at_least=False)
    return {"steps": steps, "derived": d, "runs": runs, "step_s": {k: harness.summary(v) for k, v in step.items()}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 repetitions")
    p.add_argument("--reps", type=int, help="repetitions of each setting (default 5, quick 2)")
    p.add_argument("--save", action="store_true", help="append the JSON to benchmarks/baselines/autotune.json")
    p.add_argument("--real", action="store_true", help="the CPU default under torchrun instead of the simulator")
    p.add_argument("--steps", type=int, default=8, help="--real: steps per run")
    p.add_argument("--prep-dir", help="--real: prepared tiny model and data (default: a temp dir)")
    harness.add_load_arg(p)
    a = p.parse_args(argv)
    reps = a.reps or (2 if a.quick else 5)
    if a.real:
        return real(argv, reps, a.steps, a.prep_dir, a.save, a.load)
    return simulated(argv, reps, a.save, a.load)


if __name__ == "__main__":
    sys.exit(main())
