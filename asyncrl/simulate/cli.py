"""The simulator as a sizing tool: the trainer's TOML plus measured speeds -> the limits' table and verdict.

python -m asyncrl.simulate configs/tiny.toml --engine-tok-s 900 --train-s 1.2 --quick
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from typing import Optional

from asyncrl.config import load_config
from asyncrl.config.derive import num_engines
from asyncrl.simulate.engine_model import EngineModel, curve_fit_report, load_curve
from asyncrl.simulate.loop import SimConfig, Workload, sweep


def from_config(
    path: str,
    overrides: list[str],
    *,
    engine: EngineArgs,
    train_s: float,
    mean_turn_tokens: float,
    tool_s: float,
    sync_s: float,
    steps: int,
) -> tuple[SimConfig, Workload]:
    """A SimConfig from the trainer's TOML (engines, batch, group size, limits, max_running_requests,
    max_turns) plus measured speeds."""
    c = load_config(path, overrides)
    engines = max(1, num_engines(c))
    model = engine.model(c.rollout.max_running_requests)
    cfg = SimConfig(
        engines=engines,
        batch=c.data.rollout_batch_size,
        group_size=c.algorithm.group_size,
        inflight=c.rollout_buffer.max_inflight_groups,
        buffered=c.rollout_buffer.max_buffered_groups,
        steps=steps,
        engine=model,
    )
    wl = Workload(
        name=path,
        mean_turn_tokens=mean_turn_tokens,
        max_turns=c.agentloop.max_turns,
        tool_s=(tool_s / 2, tool_s * 1.5),
        train_s=train_s,
        sync_s=sync_s,
    )
    return cfg, wl


@dataclass(frozen=True)
class EngineArgs:
    """The engine model as the command line gives it: a measured curve, or peak + half-saturation."""

    curve: Optional[list[tuple[float, float]]] = None
    table: bool = False
    peak_tok_s: Optional[float] = None
    c_half: Optional[float] = None

    def model(self, max_running: int) -> EngineModel:
        if self.curve is not None:
            return EngineModel.from_measured(self.curve, max_running=max_running, table=self.table)
        assert self.peak_tok_s is not None
        return EngineModel(
            peak_tok_s=self.peak_tok_s, max_running=max_running, c_half=self.c_half or max(1.0, max_running / 2)
        )


def _describe_engine(args: EngineArgs, m: EngineModel) -> list[str]:
    lines = [
        f"engine model: tok/s(r) = {m.peak_tok_s:.0f} x r / (r + {m.c_half:.2f}), r <= {m.max_running} running"
        + (" (the measured points are used as a table; the fit is shown for reference)" if m.curve else "")
    ]
    if args.curve is not None:
        lines.append(f"{'concurrency':>11} {'measured':>9} {'fit':>9} {'rel.err':>8}")
        for r in curve_fit_report(args.curve, m.peak_tok_s, m.c_half):
            lines.append(f"{r['concurrency']:>11g} {r['tok_s']:9.0f} {r['fit_tok_s']:9.0f} {r['rel_err']:+8.1%}")
    return lines


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m asyncrl.simulate",  # not __main__.py
        description="What limits for N engines of this speed and a trainer of that speed?",
    )
    ap.add_argument("config", help="the trainer's TOML (engines, batch, group size, limits are read from it)")
    ap.add_argument("overrides", nargs="*", help="key=value, as for launch/train.py")
    eng = ap.add_mutually_exclusive_group(required=True)
    eng.add_argument(
        "--engine-curve",
        metavar="JSON",
        help="one engine's measured tokens/s at several concurrencies (benchmarks/engine_curve.py "
        "--out); the model is the curve fitted to it",
    )
    eng.add_argument(
        "--engine-tok-s", type=float, help="one engine's peak generated tokens/s (the asymptote; with --c-half)"
    )
    ap.add_argument(
        "--c-half",
        type=float,
        default=None,
        help="with --engine-tok-s: running requests at which an engine makes half its peak "
        "(default max_running_requests / 2)",
    )
    ap.add_argument(
        "--engine-table",
        action="store_true",
        help="with --engine-curve: use the measured points as they are (piecewise linear) instead of the fit",
    )
    ap.add_argument("--train-s", type=float, required=True, help="measured train + sync seconds per step")
    ap.add_argument("--turn-tokens", type=float, default=250.0, help="mean generated tokens per turn")
    ap.add_argument("--tool-s", type=float, default=0.5, help="mean tool-call seconds")
    ap.add_argument("--sync-s", type=float, default=0.2, help="weight-sync pause seconds")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--quick", action="store_true", help="16 steps, measured from step 8")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.engine_curve is None and args.engine_table:
        ap.error("--engine-table needs --engine-curve")
    if args.engine_curve is not None and args.c_half is not None:
        ap.error("--c-half goes with --engine-tok-s (with --engine-curve it is fitted)")
    try:
        engine = (
            EngineArgs(curve=load_curve(args.engine_curve), table=args.engine_table)
            if args.engine_curve
            else EngineArgs(peak_tok_s=args.engine_tok_s, c_half=args.c_half)
        )
        cfg, wl = from_config(
            args.config,
            args.overrides,
            engine=engine,
            train_s=args.train_s,
            mean_turn_tokens=args.turn_tokens,
            tool_s=args.tool_s,
            sync_s=args.sync_s,
            steps=16 if args.quick else args.steps,
        )
    except ValueError as e:
        ap.error(str(e))
    _report(cfg, wl, engine, args.train_s)
    return 0


def _report(cfg: SimConfig, wl: Workload, engine: EngineArgs, train_s: float) -> None:
    """Sweep a few fixed limits and auto; print the table, the suggestion, and JSON last."""
    cfg = replace(cfg, measure_from=min(10, cfg.steps // 2))
    start = cfg.derived_inflight() if cfg.inflight == "auto" else int(cfg.inflight)
    bound = max(1, cfg.resolved_buffered() - cfg.batch)
    limits = sorted({max(1, min(bound, round(start * f))) for f in (0.25, 0.5, 1.0, 2.0)})
    rows, auto = sweep(cfg, wl, limits)
    print("\n".join(_describe_engine(engine, cfg.engine)))
    print(
        f"{cfg.engines} engines, batch {cfg.batch} x {cfg.group_size}, "
        f"max_buffered_groups {cfg.resolved_buffered()}, train {train_s:g} s/step"
    )
    print(f"{'max_inflight_groups':>20} {'groups/s':>9} {'staleness':>9} {'wait_inflight':>13} {'wait_buffer':>11}")
    for r in rows + [dict(auto, limit=f"auto->{auto['limit']}")]:
        print(
            f"{r['limit']!s:>20} {r['groups_s']:9.2f} {r['staleness']:9.2f} {r['wait_inflight']:13.2f} "
            f"{r['wait_buffer']:11.2f}"
        )
    best = max(rows, key=lambda r: r["groups_s"])
    verdict = (
        "the buffer limit binds: training is the bottleneck (max_buffered_groups bounds the staleness)"
        if best["wait_buffer"] >= 0.5
        else "the in-flight limit decides the engines' load"
    )
    print(f"suggested max_inflight_groups = {auto['limit']} (auto settled at step {auto['settled_at']}); {verdict}")
    fit = {"peak_tok_s": cfg.engine.peak_tok_s, "c_half": cfg.engine.c_half, "max_running": cfg.engine.max_running}
    if engine.curve is not None:
        fit["rel_err"] = {
            f"{r['concurrency']:g}": round(r["rel_err"], 4)
            for r in curve_fit_report(engine.curve, cfg.engine.peak_tok_s, cfg.engine.c_half)
        }
    print(
        json.dumps(
            {
                "engine": fit,
                "rows": rows,
                "auto": {k: v for k, v in auto.items() if k != "changes"},
                "suggested_max_inflight_groups": auto["limit"],
            }
        )
    )
