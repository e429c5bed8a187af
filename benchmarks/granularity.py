"""``sample`` (Miles) against ``group`` (RLinf) counting of the in-flight limit, at the same trajectory budget.

Drives the broker core (``asyncrl.broker.core.BrokerCore``) with ``benchmarks/simulate.py``'s simulated engines,
multi-turn trajectories whose lengths vary widely (lognormal turns, 1..4 turns, tool latency) and a trainer.
Under ``group`` a group holds its slot until its slowest trajectory returns; under ``sample`` each finished
trajectory frees its own slot and a new group goes out once ``group_size`` have finished (Miles' fully-async
default), so the engines stay full when lengths vary. Three regimes, ``group_size`` 8, 2 engines saturating at
16 running requests each:
  saturation: a budget of 4 groups = 32 trajectories, the engines' saturation (the limit binds);
  rlinf_margin: the derived ``ceil(max_running x engines x 1.2 / group_size)`` = 15 groups (above saturation);
  training_bound: the saturation budget with a slow trainer (the buffer limit binds, not the in-flight one).
Each repetition is one seed, both sides run on it one after the other (order alternating); the figures are
simulated (groups trained per simulated second, staleness), so the machine's load moves the wall time only; the
load is recorded all the same. The ratio per regime is sample / group throughput, median and spread over seeds.
``--load`` (``benchmarks/harness.py``): idle, under the fixed background load, or both (default; the JSON's ``idle``
and ``loaded``): the simulated figures are the same in both (a check that the load does not leak into them), the
wall seconds (``figures.wall_s``) are not.

    python benchmarks/granularity.py --reps 10 [--save]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Report, add_args, conditions, interleave, summary  # noqa: E402
from simulate import SimSetup, simulate  # noqa: E402

REGIMES = {
    "saturation": dict(inflight=4, train_s=1.0),
    "rlinf_margin": dict(inflight=None, train_s=1.0),
    "training_bound": dict(inflight=4, train_s=40.0),
}
BASE = dict(batch=16, group_size=8, buffered=64, engines=2, max_running=48, n_sat=16, tail_sigma=1.2, max_turns=4)


def _regimes(rep: Report, *, steps: int, reps: int) -> dict:
    """Every regime under the current condition: the ratios to ``rep``, the figures back (the simulated figures
    are the load's to move only through their wall time, recorded as ``wall_s``)."""
    t0 = time.perf_counter()
    figures: dict[str, dict] = {}
    for regime, knobs in REGIMES.items():
        seed = iter(range(10_000))
        results: dict[str, list] = {"group": [], "sample": []}

        def side(gran: str, knobs=knobs, seed=seed, results=results):
            s = next(seed) // 2  # both sides of a repetition run the same seed
            r = simulate(SimSetup(**BASE, **knobs, granularity=gran, steps=steps, seed=s))
            assert not r.failure, r.failure
            results[gran].append(r)
            return r.groups_per_s

        tput = interleave({"group": lambda: side("group"), "sample": lambda: side("sample")}, reps=reps, warmup=0)
        rep.ratio(
            f"{regime}_sample_over_group_throughput_ratio",
            tput["sample"],
            tput["group"],
            target=0.97,
            note="simulated groups/s; sample must not lose throughput (it gains where the in-flight limit binds)",
        )
        figures[regime] = {
            gran: {
                "groups_per_s": summary([r.groups_per_s for r in rs]),
                "staleness_mean": summary([r.mean("rollout/data_staleness/mean") for r in rs]),
                "inflight_groups_mean": summary([r.mean("rollout/buffer/num_inflight_groups") for r in rs]),
                "inflight_samples_mean": summary([r.mean("rollout/buffer/num_inflight_samples") for r in rs]),
                "wait_inflight": summary([r.mean("rollout/buffer/admission_wait_inflight_limit") for r in rs]),
                "wait_buffer": summary([r.mean("rollout/buffer/admission_wait_buffer_full") for r in rs]),
            }
            for gran, rs in results.items()
        }
        for gran in ("group", "sample"):
            f = figures[regime][gran]
            print(
                f"{regime:15s} {gran:6s} groups/s {f['groups_per_s']['median']:.3f} "
                f"(min {f['groups_per_s']['min']:.3f} max {f['groups_per_s']['max']:.3f})  staleness "
                f"{f['staleness_mean']['median']:.2f}  in flight {f['inflight_groups_mean']['median']:.1f} groups / "
                f"{f['inflight_samples_mean']['median']:.1f} trajectories",
                flush=True,
            )
    figures["wall_s"] = time.perf_counter() - t0
    return figures


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, reps=10, load=True)
    args = ap.parse_args(argv)
    steps = 12 if args.quick else 24
    rep = Report("granularity", argv)
    for cond in conditions(args.load):
        with rep.condition(cond):
            rep.record({"figures": _regimes(rep, steps=steps, reps=args.reps)})
    return rep.emit({"setup": {**BASE, "steps": steps, "regimes": REGIMES}}, save=args.save)


if __name__ == "__main__":
    main()
