"""The simulator's event loop: engines, multi-turn trajectories, tools and the trainer around the real core.

See the package's docstring (``asyncrl/simulate/__init__.py``) for the model; ``simulate(cfg, workload)``
runs one setup, ``sweep`` fixed limits and auto on one setup.
"""

from __future__ import annotations

import gc
import heapq
import math
import random
import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Optional, Union

from asyncrl.broker.core import BrokerCore, CoreSettings
from asyncrl.broker.types import PromptItem, Trajectory
from asyncrl.simulate.engine_model import EngineModel

MAX_WORKERS = 64  # broker workers the engines are pooled behind (from when the core chose a worker by a scan; kept: the
# D figures were measured with it, and the core's choice is O(log workers) now, so it no longer costs)


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
    auto_start: Optional[int] = None
    """Where auto starts (None: the derived limit); within the buffer bound either way."""

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
        self.queue: deque = deque()
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
        start = (
            min(cfg.auto_start or cfg.derived_inflight(), max(1, buffered - cfg.batch)) if auto else int(cfg.inflight)
        )
        self.core = BrokerCore(
            [PromptItem(i, f"q{i}") for i in range(4096)],
            clock=lambda: self.now,
            settings=CoreSettings(
                rollout_batch_size=cfg.batch,
                group_size=cfg.group_size,
                max_inflight_groups=start,
                max_buffered_groups=buffered,
                max_dropped_groups_per_step=10 * cfg.batch,
                submission_granularity="group",  # RLinf's counting, the derived default
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
        r = len(e.running)
        if r and not self.paused:
            e.v += self.curve[r] / r * (self.now - e.t)
        e.t = self.now

    def _schedule_engine(self, i: int) -> None:
        e = self.engines[i]
        e.gen += 1
        rate = self._rate(len(e.running))
        if e.running and rate > 0:
            t = self.now + max(0.0, e.running[0][0] - e.v) / rate
            self._push(t, "engine", (i, e.gen))

    def _start_turn(self, req: _Req) -> None:
        e = self.engines[req.engine]
        self._sync_engine(e)
        if self._admit_turn(e, req):
            self._schedule_engine(req.engine)

    def _admit_turn(self, e: _Engine, req: _Req) -> bool:
        """Run the turn, or queue it when the engine's slots are full; True when it runs (reschedule)."""
        if len(e.running) >= self.m.max_running:
            e.queue.append(req)
            self.n_queued += 1
            return False
        self._run(e, req)
        return True

    def _run(self, e: _Engine, req: _Req) -> None:
        tokens = min(8 * self.wl.mean_turn_tokens, self.rng.lognormvariate(self.mu, self.wl.tail_sigma))
        r = len(e.running)
        self.tok_s += self.curve[r + 1] - self.curve[r]
        heapq.heappush(e.running, (e.v + tokens, self.seq, req))
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
            self.tok_s -= self.curve[len(e.running) + 1] - self.curve[len(e.running)]
            self.n_running -= 1
            self._turn_done(req)
        while e.queue and len(e.running) < self.m.max_running:
            self.n_queued -= 1
            self._run(e, e.queue.popleft())
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
        """The core's new groups: each to the least-loaded engine of its worker's pool, all its trajectories
        started at once (one engine update and one reschedule per group, not per trajectory)."""
        engines, rng, max_turns = self.engines, self.rng, self.wl.max_turns
        for iss in self.core.take_issues():
            pool = self.pools[int(iss.worker_id[1:])]
            i = pool[0] if len(pool) == 1 else min(pool, key=lambda k: len(engines[k].running) + len(engines[k].queue))
            e = engines[i]
            self._sync_engine(e)
            started = False
            for j in range(iss.group_size):
                started |= self._admit_turn(e, _Req(iss.group_id, j, i, rng.randint(1, max_turns)))
            if started:
                self._schedule_engine(i)

    def _set_paused(self, paused: bool) -> None:
        for e in self.engines:
            self._sync_engine(e)
        self.paused = paused
        for i in range(len(self.engines)):
            self._schedule_engine(i)

    def run(self) -> SimResult:
        # The run allocates millions of short-lived objects and no reference cycles: the cyclic collector's
        # passes over the live set cost ~20% of a 1,000-engine run and free nothing; on again afterwards.
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._run_loop()
        finally:
            if collecting:
                gc.enable()

    def _run_loop(self) -> SimResult:
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
