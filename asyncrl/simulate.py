"""An event-driven simulator of the async loop around the broker core, fast enough for 1,000 engines.

It drives ``asyncrl.broker.core.BrokerCore`` (the class the broker process runs) with a simulated
clock; only the engines, the agent workers' multi-turn trajectories, the tools and the trainer are
modelled:
- an engine runs up to ``max_running`` requests (more wait in its queue, FIFO) and shares its token
  rate among them (processor sharing): ``T(r) = peak_tok_s x r / (r + c_half)``, the curve fitted to
  the CPU engine's measured tokens/s at concurrency 1..64 (``benchmarks/engine_curve.py``; within
  about 10% at every level), or a measured table (``EngineModel``); a weight sync pauses every
  engine for ``sync_s``;
- a trajectory has 1..``max_turns`` turns, lognormal tokens per turn, and a tool call between turns
  (uniform latency, plus a share ``tool_tail_p`` of slow calls with lognormal latency, the long tail);
- the trainer asks for a batch, trains ``train_s``, syncs, and asks again (``runner.async_mode``).
Engines are pooled behind at most ``MAX_WORKERS`` broker workers (each pool routes to its
least-loaded engine), so the core's per-issue worker choice stays cheap at 1,000 engines.
The engines report their figures (running, queued, generated tokens/s) every ``report_s`` as the
actor's scraper does, through ``BrokerCore.engine_figures``.

    r = simulate(SimConfig(engines=8, batch=16, inflight="auto"), Workload())
    r.throughput_groups_s, r.mean_staleness(), r.limits      # per-step in-flight limits

As a sizing tool (the trainer's TOML plus measured speeds):

    python -m asyncrl.simulate configs/tiny.toml --engine-tok-s 900 --train-s 1.2 --quick
    python -m asyncrl.simulate configs/tiny.toml --engine-curve benchmarks/baselines/engine_curve.json --train-s 1.2
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass, field, replace
from typing import Optional, Union

from asyncrl.broker.core import BrokerCore, CoreSettings
from asyncrl.broker.types import PromptItem, Trajectory
from asyncrl.config import load_config
from asyncrl.config.derive import num_engines

MAX_WORKERS = 64  # broker workers the engines are pooled behind (the core picks a worker by a scan)


@dataclass(frozen=True)
class Workload:
    """One shape of rollout work."""

    name: str = "generation-bound"
    mean_turn_tokens: float = 250.0
    tail_sigma: float = 0.8
    """Lognormal sigma of a turn's token count."""
    max_turns: int = 2
    tool_s: tuple[float, float] = (0.2, 1.0)
    tool_tail_p: float = 0.0
    """Share of tool calls that are slow ..."""
    tool_tail_mean_s: float = 8.0
    """... with this mean latency (lognormal, sigma 1)."""
    train_s: float = 0.5
    sync_s: float = 0.2


@dataclass(frozen=True)
class EngineModel:
    """One engine's generated tokens/s against the requests it runs, ``T(r)``; each running request
    gets ``T(r) / r`` (processor sharing).

    ``T`` is the measured curve when ``curve`` is given (piecewise linear through (0, 0) and the
    points, flat past the last one: an extrapolation), else the saturating curve fitted to it,
    ``T(r) = peak_tok_s x r / (r + c_half)`` (``fit_saturation``; ``benchmarks/engine_curve.py``
    measures the CPU engine's). Neither is assumed flat at a knee: the engine keeps gaining a little
    from more requests, with diminishing returns, as the measured one does.
    """

    peak_tok_s: float = 4000.0
    """The asymptote of the fitted curve (tokens/s of one engine at unbounded concurrency)."""
    c_half: float = 8.0
    """Running requests at which an engine makes half its peak tokens/s."""
    max_running: int = 32
    """Requests it runs at once (SGLang --max-running-requests); more queue."""
    curve: tuple[tuple[float, float], ...] = ()
    """Measured (running requests, tokens/s) points; when given they replace the fitted curve."""

    def __post_init__(self):
        if self.peak_tok_s <= 0 or self.c_half <= 0 or self.max_running < 1:
            raise ValueError(f"EngineModel: peak_tok_s, c_half and max_running must be positive, got {self}")
        xs = [c for c, _ in self.curve]
        if self.curve and (xs != sorted(set(xs)) or xs[0] <= 0 or any(t <= 0 for _, t in self.curve)):
            raise ValueError(
                f"EngineModel.curve: concurrencies must be positive and increasing and tokens/s "
                f"positive, got {self.curve}"
            )

    def tok_s(self, r: int) -> float:
        """Generated tokens/s of one engine running ``r`` requests."""
        if r <= 0:
            return 0.0
        if not self.curve:
            return saturation_tok_s(r, self.peak_tok_s, self.c_half)
        x0, t0 = 0.0, 0.0
        for x1, t1 in self.curve:
            if r <= x1:
                return t0 + (t1 - t0) * (r - x0) / (x1 - x0)
            x0, t0 = x1, t1
        return t0

    @classmethod
    def from_measured(cls, points: list[tuple[float, float]], *, max_running: int, table: bool = False) -> EngineModel:
        """The model fitted to measured (concurrency, tokens/s) points (``table``: the points themselves)."""
        peak, c_half = fit_saturation(points)
        return cls(
            peak_tok_s=peak,
            c_half=c_half,
            max_running=max_running,
            curve=tuple((float(c), float(t)) for c, t in sorted(points)) if table else (),
        )


def saturation_tok_s(c: float, peak: float, c_half: float) -> float:
    """``peak x c / (c + c_half)``: linear at low concurrency, half the peak at ``c_half``, saturating."""
    return peak * c / (c + c_half)


def fit_saturation(points: list[tuple[float, float]]) -> tuple[float, float]:
    """``(peak, c_half)`` of ``saturation_tok_s`` minimising the squared *relative* error over the
    measured (concurrency, tokens/s) points: a log grid over ``c_half`` (ratio 1.002, from 1/1000 of
    the smallest to 1000 x the largest concurrency), the best ``peak`` for each in closed form."""
    pts = [(float(c), float(t)) for c, t in points]
    if len(pts) < 2 or any(c <= 0 or t <= 0 for c, t in pts):
        raise ValueError(f"fit_saturation: needs >= 2 points with positive concurrency and tokens/s, got {points}")
    lo, hi = min(c for c, _ in pts) / 1000, max(c for c, _ in pts) * 1000
    best = (math.inf, 0.0, 0.0)
    h = lo
    while h <= hi:
        a = [(c / (c + h)) / t for c, t in pts]  # fit / measured = peak x a_i
        peak = sum(a) / sum(x * x for x in a)
        err = sum((peak * x - 1) ** 2 for x in a)
        best = min(best, (err, peak, h))
        h *= 1.002
    return best[1], best[2]


def curve_fit_report(points: list[tuple[float, float]], peak: float, c_half: float) -> list[dict]:
    """Per measured point: the fitted tokens/s and the relative error (fit / measured - 1)."""
    return [
        {
            "concurrency": c,
            "tok_s": t,
            "fit_tok_s": saturation_tok_s(c, peak, c_half),
            "rel_err": saturation_tok_s(c, peak, c_half) / t - 1,
        }
        for c, t in points
    ]


def load_curve(path: str) -> list[tuple[float, float]]:
    """Measured (concurrency, tokens/s) points from ``benchmarks/engine_curve.py``'s JSON."""
    try:
        data = json.loads(open(path).read())
        return [(float(p["concurrency"]), float(p["tok_s"])) for p in data["curve"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"--engine-curve {path!r}: not an engine_curve.py result (a 'curve' list of "
            f"{{'concurrency', 'tok_s'}}): {e}"
        ) from e


@dataclass(frozen=True)
class SimConfig:
    engines: int = 2
    batch: int = 16
    group_size: int = 4
    inflight: Union[int, str] = "auto"
    buffered: Optional[int] = None
    """None: 2 x batch."""
    steps: int = 24
    engine: EngineModel = EngineModel()
    report_s: float = 0.02
    seed: int = 0
    measure_from: int = 10
    """Throughput and staleness are measured over steps measure_from.. (after the settling deadline)."""

    def derived_inflight(self) -> int:
        return max(1, math.ceil(self.engine.max_running * self.engines * 1.2 / self.group_size))

    def resolved_buffered(self) -> int:
        return self.buffered or 2 * self.batch


@dataclass
class SimResult:
    cfg: SimConfig
    workload: Workload
    step_end_t: list[float] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)
    limits: list[int] = field(default_factory=list)
    changes: list[str] = field(default_factory=list)

    def window(self, skip: int) -> tuple[int, int]:
        return min(skip, len(self.metrics) - 2), len(self.metrics)

    def throughput_groups_s(self, skip: int = 10) -> float:
        """Trained groups per second over steps ``skip``.. (after the settling deadline)."""
        a, b = self.window(skip)
        return (
            (b - a)
            * self.cfg.batch
            / (self.step_end_t[b - 1] - self.step_end_t[a - 1] if a else self.step_end_t[b - 1])
        )

    def mean_staleness(self, skip: int = 10) -> float:
        a, b = self.window(skip)
        return statistics.fmean(m["rollout/data_staleness/mean"] for m in self.metrics[a:b])

    def settled_at(self) -> int:
        """The step after which the limit never changed (0: never changed)."""
        last = 0
        for i in range(1, len(self.limits)):
            if self.limits[i] != self.limits[i - 1]:
                last = i
        return last


class _Engine:
    """Processor sharing: every running request gets rate(r) tokens/s; ``v`` = tokens served per request."""

    __slots__ = ("running", "queue", "v", "t", "gen")

    def __init__(self):
        self.running: list[tuple[float, int, object]] = []  # heap of (v at which the turn ends, seq, req)
        self.queue: list = []
        self.v = 0.0
        self.t = 0.0
        self.gen = 0  # invalidates scheduled events


@dataclass(slots=True)
class _Req:
    gid: int
    idx: int
    engine: int
    turns_left: int
    min_version: int = -1


class _Sim:
    def __init__(self, cfg: SimConfig, wl: Workload):
        self.cfg, self.wl, self.m = cfg, wl, cfg.engine
        self.rng = random.Random(cfg.seed)
        self.now = 0.0
        auto = cfg.inflight == "auto"
        buffered = cfg.resolved_buffered()
        start = min(cfg.derived_inflight(), max(1, buffered - cfg.batch)) if auto else int(cfg.inflight)
        self.core = BrokerCore(
            [PromptItem(i, f"q{i}") for i in range(4096)],
            clock=lambda: self.now,
            settings=CoreSettings(
                rollout_batch_size=cfg.batch,
                group_size=cfg.group_size,
                max_inflight_groups=start,
                max_buffered_groups=buffered,
                max_dropped_groups_per_step=10 * cfg.batch,
                submission_granularity="sample",
                seed=cfg.seed,
                no_data_warning_s=1e9,
                worker_heartbeat_timeout_s=1e9,
                inflight_autotune=auto,
            ),
        )
        n_workers = min(cfg.engines, MAX_WORKERS)
        self.pools = [list(range(w, cfg.engines, n_workers)) for w in range(n_workers)]
        self.core.hold_issuing()  # else the first worker to join takes the whole first burst
        for w, pool in enumerate(self.pools):
            self.core.add_worker(f"w{w}", capacity=self.m.max_running * len(pool))
        self.core.release_issuing()
        self.engines = [_Engine() for _ in range(cfg.engines)]
        self.events: list = []
        self.seq = 0
        self.paused = False
        self.done: dict[int, list] = {}
        self.mu = math.log(wl.mean_turn_tokens) - wl.tail_sigma**2 / 2
        self.n_running = self.n_queued = 0
        self.tok_s = 0.0  # sum over engines of T(r)
        self.curve = [self.m.tok_s(r) for r in range(self.m.max_running + 1)]  # T(r), r <= max_running

    # ----------------------------------------------------------------- engines
    def _rate(self, r: int) -> float:
        return 0.0 if self.paused or r == 0 else self.curve[r] / r

    def _sync_engine(self, e: _Engine) -> None:
        e.v += self._rate(len(e.running)) * (self.now - e.t)
        e.t = self.now

    def _schedule_engine(self, i: int) -> None:
        e = self.engines[i]
        e.gen += 1
        rate = self._rate(len(e.running))
        if e.running and rate > 0:
            t = self.now + max(0.0, e.running[0][0] - e.v) / rate
            self._push(t, "engine", (i, e.gen))

    def _engine_tok_s(self, r: int) -> float:
        return self.curve[r]

    def _start_turn(self, req: _Req) -> None:
        e = self.engines[req.engine]
        self._sync_engine(e)
        if len(e.running) >= self.m.max_running:
            e.queue.append(req)
            self.n_queued += 1
            return
        self._run(e, req)
        self._schedule_engine(req.engine)

    def _run(self, e: _Engine, req: _Req) -> None:
        tokens = min(8 * self.wl.mean_turn_tokens, self.rng.lognormvariate(self.mu, self.wl.tail_sigma))
        self.tok_s -= self._engine_tok_s(len(e.running))
        heapq.heappush(e.running, (e.v + tokens, self.seq, req))
        self.tok_s += self._engine_tok_s(len(e.running))
        self.seq += 1
        self.n_running += 1
        if req.min_version < 0:
            req.min_version = self.core.version

    def _engine_event(self, i: int, gen: int) -> None:
        e = self.engines[i]
        if gen != e.gen:
            return
        self._sync_engine(e)
        while e.running and e.running[0][0] <= e.v + 1e-9:
            _, _, req = heapq.heappop(e.running)
            self.tok_s -= self._engine_tok_s(len(e.running) + 1) - self._engine_tok_s(len(e.running))
            self.n_running -= 1
            self._turn_done(req)
        while e.queue and len(e.running) < self.m.max_running:
            self.n_queued -= 1
            self._run(e, e.queue.pop(0))
        self._schedule_engine(i)

    def _turn_done(self, req: _Req) -> None:
        req.turns_left -= 1
        if req.turns_left > 0:
            wl = self.wl
            if self.rng.random() < wl.tool_tail_p:
                lat = self.rng.lognormvariate(math.log(wl.tool_tail_mean_s) - 0.5, 1.0)
            else:
                lat = self.rng.uniform(*wl.tool_s)
            self._push(self.now + lat, "tool", req)
            return
        t = Trajectory([0], [1], [1], [0.0], min_version=req.min_version, max_version=self.core.version)
        group = self.done.setdefault(req.gid, [])
        group.append(t)
        self.core.trajectory_finished(req.gid, req.idx, t)
        if len(group) == self.cfg.group_size:
            self.core.group_finished(req.gid, self.done.pop(req.gid))

    # ----------------------------------------------------------------- the loop
    def _push(self, t: float, kind: str, payload) -> None:
        heapq.heappush(self.events, (t, self.seq, kind, payload))
        self.seq += 1

    def _issue(self) -> None:
        for iss in self.core.take_issues():
            pool = self.pools[int(iss.worker_id[1:])]
            i = min(pool, key=lambda k: len(self.engines[k].running) + len(self.engines[k].queue))
            for j in range(iss.group_size):
                self._start_turn(_Req(iss.group_id, j, i, self.rng.randint(1, self.wl.max_turns)))

    def _set_paused(self, paused: bool) -> None:
        for e in self.engines:
            self._sync_engine(e)
        self.paused = paused
        for i in range(len(self.engines)):
            self._schedule_engine(i)

    def run(self) -> SimResult:
        res = SimResult(self.cfg, self.wl)
        step = 0
        self.core.request_batch(step)
        self._push(0.0, "report", None)
        while step < self.cfg.steps:
            self._issue()
            batch = self.core.take_batch()
            if batch is not None:
                res.metrics.append(batch.metrics)
                res.limits.append(int(batch.metrics["rollout/buffer/inflight_limit"]))
                self._push(self.now + self.wl.train_s, "trained", None)
            t, _, kind, payload = heapq.heappop(self.events)
            self.now = t
            if kind == "engine":
                self._engine_event(*payload)
            elif kind == "tool":
                self._start_turn(payload)
            elif kind == "report":
                self.core.engine_figures(
                    running_reqs=self.n_running,
                    queue_reqs=self.n_queued,
                    gen_tokens_per_s=0.0 if self.paused else self.tok_s,
                )
                self._push(self.now + self.cfg.report_s, "report", None)
            elif kind == "trained":
                self.core.sync_begin("retract")
                self._set_paused(True)
                self._push(self.now + self.wl.sync_s, "synced", None)
            elif kind == "synced":
                step += 1
                self._set_paused(False)
                self.core.sync_end(step)
                res.step_end_t.append(self.now)
                if step < self.cfg.steps:
                    self.core.request_batch(step)
        res.changes = [
            f"{c.old} -> {c.new}: {c.reason}" for c in (self.core.autotuner.history if self.core.autotuner else [])
        ]
        return res


def simulate(cfg: SimConfig, workload: Workload) -> SimResult:
    return _Sim(cfg, workload).run()


# --------------------------------------------------------------------- the sizing tool
def sweep(cfg: SimConfig, wl: Workload, limits: list[int]) -> tuple[list[dict], dict]:
    """Fixed limits and auto on one setup: rows of (limit, throughput, staleness) and auto's row."""
    rows = []
    for n in limits:
        r = simulate(replace(cfg, inflight=n), wl)
        rows.append(_row(r, n))
    a = simulate(replace(cfg, inflight="auto"), wl)
    auto = _row(a, a.limits[-1]) | {"settled_at": a.settled_at(), "changes": a.changes, "limits": a.limits}
    return rows, auto


def _row(r: SimResult, limit: int) -> dict:
    k = r.cfg.measure_from
    return {
        "limit": limit,
        "groups_s": r.throughput_groups_s(k),
        "staleness": r.mean_staleness(k),
        "wait_inflight": _mean(r, "rollout/buffer/admission_wait_inflight_limit", k),
        "wait_buffer": _mean(r, "rollout/buffer/admission_wait_buffer_full", k),
    }


def _mean(r: SimResult, key: str, skip: int) -> float:
    a, b = r.window(skip)
    return statistics.fmean(m.get(key, 0.0) for m in r.metrics[a:b])


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
    ap = argparse.ArgumentParser(description="What limits for N engines of this speed and a trainer of that speed?")
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


if __name__ == "__main__":
    sys.exit(main())
