"""The README's picture of a run: four panels drawn from a run directory's ``metrics.jsonl``.

    python docs/plot_run.py runs/tiny/metrics.jsonl -o docs/healthy_run.png

Panels, by metric name (described in ``docs/metrics.py``):
  * reward: ``reward/mean`` per step, its 5-step mean, and held-out accuracy (``eval/test/accuracy``) where
    it was measured;
  * staleness: ``rollout/data_staleness/mean`` and ``/max`` of the trained groups;
  * admission waits: the fraction of each step the broker's admission was blocked by each limit,
    ``rollout/buffer/admission_wait_inflight_limit`` and ``rollout/buffer/admission_wait_buffer_full``;
  * time per step: ``time/wait_data``, ``time/training`` and ``time/sync_weights`` stacked, with ``time/step``.
A metric a panel needs that no record has is an error naming it (a run of another kind, or a renamed metric).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REWARD, HELDOUT = "reward/mean", "eval/test/accuracy"
STALENESS = ("rollout/data_staleness/mean", "rollout/data_staleness/max")
WAITS = ("rollout/buffer/admission_wait_inflight_limit", "rollout/buffer/admission_wait_buffer_full")
SPLIT = ("time/wait_data", "time/training", "time/sync_weights")
STEP_TIME = "time/step"
REQUIRED = (REWARD, *STALENESS, *WAITS, *SPLIT, STEP_TIME)
TITLES = ("reward", "staleness (steps)", "admission waits (fraction of step)", "time per step (s)")


def read_records(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl``, one per non-blank line (a step may have several: evals log apart)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the records that have it, in file order."""
    pts = [(int(r["step"]), float(r[key])) for r in records if r.get(key) is not None and "step" in r]
    return [s for s, _ in pts], [v for _, v in pts]


def _check(records: list[dict]) -> None:
    missing = [k for k in REQUIRED if not series(records, k)[0]]
    if missing:
        raise ValueError(f"no record has {', '.join(missing)}: is this an asyncrl run's metrics.jsonl?")


def _running_mean(values: list[float], window: int = 5) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def _reward(ax, records: list[dict]) -> None:
    steps, reward = series(records, REWARD)
    ax.plot(steps, reward, color="tab:blue", alpha=0.35, lw=1, label="reward/mean")
    ax.plot(steps, _running_mean(reward), color="tab:blue", lw=2, label="5-step mean")
    ev_steps, ev = series(records, HELDOUT)
    if ev_steps:
        ax.plot(ev_steps, ev, "o", color="tab:green", ms=6, label="held-out accuracy")
        for x, y in zip(ev_steps, ev):
            ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    ax.set_ylim(-0.02, 1.02)


def _staleness(ax, records: list[dict]) -> None:
    for key, style in zip(STALENESS, ("-", ":")):
        ax.plot(*series(records, key), style, color="tab:purple", lw=1.5, label=key.rsplit("/", 1)[-1])
    ax.set_ylim(bottom=0)


def _waits(ax, records: list[dict]) -> None:
    for key, color in zip(WAITS, ("tab:orange", "tab:red")):
        ax.plot(*series(records, key), color=color, lw=1.3, label=key.split("admission_wait_")[-1])
    ax.set_ylim(-0.02, 1.02)


def _split(ax, records: list[dict]) -> None:
    bottom: dict[int, float] = {}
    for key, color in zip(SPLIT, ("tab:gray", "tab:blue", "tab:orange")):
        steps, vals = series(records, key)
        base = [bottom.get(s, 0.0) for s in steps]
        ax.bar(steps, vals, bottom=base, width=1.0, color=color, label=key.split("/", 1)[1])
        bottom.update({s: b + v for s, b, v in zip(steps, base, vals)})
    ax.plot(*series(records, STEP_TIME), color="black", lw=1, label="step")
    ax.set_ylim(bottom=0)


def draw(records: list[dict], title: str = ""):
    """The figure (2 x 2 panels, titled as ``TITLES``) for these records; raises ValueError naming a missing metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _check(records)
    fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    for ax, name, panel in zip(axes.flat, TITLES, (_reward, _staleness, _waits, _split)):
        panel(ax, records)
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    for ax in axes[1]:
        ax.set_xlabel("step")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", type=Path, help="a run directory's metrics.jsonl")
    ap.add_argument("-o", "--out", type=Path, default=Path("docs/healthy_run.png"), help="PNG to write")
    ap.add_argument("--title", default="", help="a title over the panels")
    ap.add_argument("--dpi", type=int, default=80, help="dots per inch (the figure is 10 x 6 inches)")
    a = ap.parse_args(argv)
    try:
        fig = draw(read_records(a.metrics), a.title)
    except (OSError, ValueError) as e:
        print(f"plot_run: {a.metrics}: {e}", file=sys.stderr)
        return 1
    fig.savefig(a.out, dpi=a.dpi)
    print(f"wrote {a.out} ({a.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
