"""What actor rank 0 derives for the step records and the run's summary (pure: no sockets, the caller logs).

- ``broker_accounting(status)``: where every issued group is (``issued == trained + dropped + held + reissued``).
- ``wait_split(batch_metrics, wait_s, async_mode=)``: the batch wait counted once, as RLinf splits time/step.
- ``new_summary()`` / ``record_step(summary, m)`` / ``print_summary(cfg, summary, run_dir)``: the per-step figures
  kept for the end of the run, then ``summary.json`` and the console block.

    summary = new_summary(); record_step(summary, m); print_summary(cfg, summary, run_dir)
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

SUMMARY_KEYS = (
    "reward/mean",
    "rollout/data_staleness/mean",
    "rollout/data_staleness/max",
    "time/step",
    "time/training",
    "time/wait_data",
    "time/rollout",
    "time/sync_weights",
)
"""The keys of each step's record the summary keeps."""


def broker_accounting(status: dict) -> dict[str, float]:
    """Where every issued group is: trained, dropped, held (in flight or buffered), or re-issued
    after its worker died. ``issued == trained + dropped + held + reissued`` at all times."""
    c = status.get("counters", {})
    return {
        "broker/issued_groups": float(c.get("issued", 0)),
        "broker/trained_groups": float(c.get("trained", 0)),
        "broker/dropped_groups": float(c.get("dropped", 0)),
        "broker/reissued_groups": float(c.get("reissued", 0)),
        "broker/held_groups": float(status.get("num_inflight_groups", 0) + status.get("num_buffered_groups", 0)),
    }


def wait_split(batch_metrics: dict[str, float], wait_s: float, *, async_mode: bool) -> dict[str, float]:
    """The batch's metrics with its wait counted once: ``time/wait_data`` in async mode, ``time/rollout`` in sync
    mode (RLinf's split: sync time/step = rollout + training + sync_weights, async = training + wait_data + sync)."""
    m = {k: v for k, v in batch_metrics.items() if k not in ("time/wait_data", "time/rollout")}
    m["time/wait_data" if async_mode else "time/rollout"] = wait_s
    return m


def new_summary() -> dict:
    return {"staleness_max": 0.0, "drops": 0.0, "steps": []}


def record_step(summary: dict, m: dict) -> None:
    """Keep the step record ``m``'s summary figures: its ``SUMMARY_KEYS``, the worst staleness, the dropped groups."""
    summary["steps"].append({k: m.get(k) for k in SUMMARY_KEYS})
    summary["staleness_max"] = max(summary["staleness_max"], m.get("rollout/data_staleness/max", 0.0))
    summary["drops"] += (
        m.get("rollout/fully_async/stale_groups_filtered", 0.0)
        + m.get("rollout/fully_async/aborted_groups_filtered", 0.0)
        + m["rollout/sample_filter/removed_groups"]
    )


def _held_out(cfg, before: float | None, after: float | None) -> str:
    """The summary's held-out score: ``n/a`` for a point not measured (a resumed run has no "before")."""
    if not cfg.runner.eval_before_after:
        return "not measured (runner.eval_before_after = false)"
    return " -> ".join(
        f"{when} {'n/a' if v is None else f'{v:.3f}'}" for when, v in (("before", before), ("after", after))
    )


def _reward_name(cfg) -> str:
    """The environment's name for its mean reward (``accuracy``, ``mean_reward``, ...); unset: Search-R1's, as the worker."""
    try:
        from asyncrl.agent.envs import get_env

        return getattr(get_env(cfg.agentloop.task_name or "searchr1"), "reward_name", "mean_reward")
    except Exception:  # no environment (a broker-only run): the generic name
        return "mean_reward"


def print_summary(cfg, summary: dict, run_dir: Path) -> None:
    steps = summary["steps"]
    rewards = [s["reward/mean"] for s in steps if s.get("reward/mean") is not None]
    first = statistics.mean(rewards[:5]) if rewards else float("nan")
    last = statistics.mean(rewards[-5:]) if rewards else float("nan")

    def avg(key):
        vals = [s[key] for s in steps if s.get(key) is not None]
        return statistics.mean(vals) if vals else 0.0

    evals = [summary.get("eval_before") or {}, summary.get("eval_after") or {}]
    name = next((e["reward_name"] for e in evals if e.get("reward_name")), None)
    name = name or ("accuracy" if any("accuracy" in e for e in evals) else _reward_name(cfg))
    out = {
        "mode": "async" if cfg.runner.async_mode else "sync",
        "steps": len(steps),
        "reward_first5": first,
        "reward_last5": last,
        "reward_gain": last - first,
        "test_score_name": name,
        f"test_{name}_before": evals[0].get(name),
        f"test_{name}_after": evals[1].get(name),
        "staleness_mean": avg("rollout/data_staleness/mean"),
        "staleness_max": summary["staleness_max"],
        "dropped_groups": summary["drops"],
        "time/step": avg("time/step"),
        "time/training": avg("time/training"),
        "time/wait_data": avg("time/wait_data"),
        "time/rollout": avg("time/rollout"),
        "time/sync_weights": avg("time/sync_weights"),
        "wall_s": summary.get("wall_s"),
        "prepare_s": summary.get("prepare_s"),
    }
    (run_dir / "summary.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [
        "",
        "=" * 72,
        f"asyncrl summary ({out['mode']}, {out['steps']} steps, run dir {run_dir})",
        f"  reward: first 5 steps {first:.3f} -> last 5 steps {last:.3f} (gain {last - first:+.3f})",
        f"  held-out {name.replace('_', ' ')}: "
        + _held_out(cfg, out[f"test_{name}_before"], out[f"test_{name}_after"]),
        f"  staleness: mean {out['staleness_mean']:.2f}, max {out['staleness_max']:.0f}; "
        f"dropped groups {out['dropped_groups']:.0f}",
        f"  time/step {out['time/step']:.2f}s = training {out['time/training']:.2f}s + wait_data "
        f"{out['time/wait_data']:.2f}s + rollout {out['time/rollout']:.2f}s + sync_weights "
        f"{out['time/sync_weights']:.2f}s",
    ]
    if out["wall_s"] is not None:
        lines.append(
            f"  wall time {out['wall_s']:.0f}s (of which preparing the embedded default {out['prepare_s'] or 0.0:.0f}s)"
        )
    lines.append("=" * 72)
    print("\n".join(lines), flush=True)
