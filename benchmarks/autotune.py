"""``max_inflight_groups = "auto"`` on the CPU default, side by side with the derived limit and twice it.

Runs the embedded default (``configs/tiny.toml``: one Megatron actor rank + the broker, one rollout
rank with the CPU engine and the agent worker) under ``torchrun --nproc_per_node 2`` three times on
the same prepared tiny model and data, changing only ``rollout_buffer.max_inflight_groups``:
``"auto"``, the derived value (``ceil(max_running_requests x engines x 1.2 / group_size)`` = 8 here)
and twice it, and reports from each run's ``metrics.jsonl`` (the steps after the first): step time,
staleness (mean, max), reward, the admission-wait fractions and the in-flight limit per step (auto's
path). On this machine the runs are short and the machine shared, so step times vary by ~20%.

    python benchmarks/autotune.py --quick        # 8 steps each, a 10-step warm start in a temp dir
    python benchmarks/autotune.py --steps 30 --prep-dir runs/autotune_bench

The last stdout line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import harness  # noqa: E402

PREPARE = ["prepare.sft_steps=10", "prepare.num_entities=60"]  # a short warm start: this measures the limits
RUN_TIMEOUT_S = 600.0  # one torchrun job; a hang fails the benchmark instead of blocking forever


def prepare(prep_dir: Path) -> tuple[float, int]:
    """Prepare the tiny model and data; return (seconds, the derived max_inflight_groups)."""
    from asyncrl.broker.core import CoreSettings
    from asyncrl.config import load_config
    from asyncrl.runner.prepare import prepare_if_needed

    t0 = time.perf_counter()
    cfg = load_config(REPO / "configs/tiny.toml", [f'prepare.dir="{prep_dir}"', *PREPARE])
    prepare_if_needed(cfg)
    return time.perf_counter() - t0, CoreSettings.from_config(cfg).max_inflight_groups


def run_job(prep_dir: Path, run_dir: Path, *, inflight: str, steps: int, extra: list[str]) -> list[dict]:
    overrides = [
        *harness.tiny_overrides(prep_dir, run_dir, steps=steps),
        *PREPARE,  # the artefacts' recipe: the job's preparation finds them made by it
        "runner.eval_before_after=false",
        f"rollout_buffer.max_inflight_groups={inflight}",
        *extra,
    ]
    what = f"autotune: the run with max_inflight_groups={inflight}"
    return harness.run_tiny_job(run_dir, overrides, timeout_s=RUN_TIMEOUT_S, what=what)[1]


def _mean(recs: list[dict], key: str) -> float:
    vals = [r[key] for r in recs if r.get(key) is not None]
    return statistics.mean(vals) if vals else 0.0


def summarize(recs: list[dict]) -> dict:
    after = recs[1:] or recs
    return {
        "time_step_s": _mean(after, "time/step"),
        "wait_data_s": _mean(after, "time/wait_data"),
        "staleness_mean": _mean(after, "rollout/data_staleness/mean"),
        "staleness_max": max((r.get("rollout/data_staleness/max", 0.0) for r in after), default=0.0),
        "reward_mean": _mean(after, "reward/mean"),
        "wait_inflight": _mean(after, "rollout/buffer/admission_wait_inflight_limit"),
        "wait_buffer": _mean(after, "rollout/buffer/admission_wait_buffer_full"),
        "inflight_limit_per_step": [r.get("rollout/buffer/inflight_limit") for r in recs],
        "steps": len(recs),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="8 steps per run")
    p.add_argument("--steps", type=int, help="steps per run (default 8 quick, 30 full)")
    p.add_argument("--prep-dir", help="prepared tiny model and data (default: a temp dir, prepared each time)")
    p.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override for every run (repeatable)",
    )
    a = p.parse_args(argv)
    steps = a.steps or (8 if a.quick else 30)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="autotune_") as tmp:
        prep_dir = Path(a.prep_dir).resolve() if a.prep_dir else Path(tmp) / "prep"
        prep_s, derived = prepare(prep_dir)
        runs = {}
        for label, value in (
            ("auto", '"auto"'),
            (f"derived={derived}", str(derived)),
            (f"2x={2 * derived}", str(2 * derived)),
        ):
            recs = run_job(prep_dir, Path(tmp) / label.split("=")[0], inflight=value, steps=steps, extra=a.extra)
            runs[label] = summarize(recs)
            s = runs[label]
            print(
                f"{label:>12}: step {s['time_step_s']:.2f}s  staleness {s['staleness_mean']:.2f} (max "
                f"{s['staleness_max']:.0f})  reward {s['reward_mean']:.3f}  wait in-flight {s['wait_inflight']:.2f} "
                f"buffer {s['wait_buffer']:.2f}  limits {s['inflight_limit_per_step']}",
                flush=True,
            )
    result = {
        "benchmark": "autotune",
        "steps": steps,
        "derived": derived,
        "runs": runs,
        "prepare_s": round(prep_s, 1),
        "total_s": round(time.perf_counter() - t_start, 1),
        "load_avg_1m": os.getloadavg()[0],
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
