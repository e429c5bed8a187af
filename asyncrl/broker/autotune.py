"""``rollout_buffer.max_inflight_groups = "auto"``: the in-flight limit that tunes itself, step by step.

Pure: no I/O, no clock of its own. The broker core calls ``observe`` once per step (at the hand-off)
with the step's figures; time is the core's injected clock, integrated into those figures.

The goal (RLinf's tuning advice, done by the broker): the *smallest* in-flight limit that keeps the
engines saturated. More in-flight groups than that only queue inside the engines and age the data
(same throughput, higher staleness); fewer starve the engines.

First, which side set the step's pace (``binding_side``, from the broker's own clock, never from step time alone:
a loaded machine slows both sides): training when the actor waited at most ``fed_frac`` of the step for its batch
(``time/wait_data``), else generation. The core writes it (``rollout/buffer/training_bound``) and logs each change.
- training sets the pace: the engines have slack, so more in flight only ages the data. It never raises the limit;
  it lowers it toward the in-flight count that supplies a batch a step at the step's group latency (Little's law:
  ``mean_inflight x trained_groups / arrived_groups``, ``fed_margin`` above; the buffer limit binds while more
  arrive than training takes), never to or below a limit at which the actor waited. Groups left in the buffer
  after the hand-off were made ahead of need and age there: it supplies that much less, over ``drain_steps``, down
  to a ``reserve`` of a batch (so a larger start comes down to a lower staleness, not just a lower limit). When a
  trim starves the actor (it waits while the in-flight limit binds), it backs up to the in-flight count that
  supplies a batch per training time (Little's law again), at most to the limit that fed it (``_starved_at``).
- generation sets the pace (the actor waits) and the in-flight limit binds: a lower limit can only make the actor
  wait longer unless the engines are past saturation, which their queue shows (the rule below). The search below
  may raise the limit but lowers it only on that evidence: a throughput that reads flat at a lower limit, measured
  at another time, may be CPU contention (the CPU default at load 6.5 went 8 -> 2-3 and ran at 0.73x). A curve
  flat without a queue (compute-bound engines with free slots) keeps its limit: cap ``max_running_requests`` at
  the knee and the engines' queue shows it.
- not told (figures without the actor's wait: the unit tests of the search): the search alone, both ways.

How it searches (a bracketing search on the measured curve throughput(mean in-flight groups)):
- every step adds a point ``(x, T)``: x = time-averaged in-flight groups of the step (not the
  limit: a lowered limit takes effect only as groups finish), T = generated tokens/s (the engines'
  ``gen_throughput`` when the shell reports it, else the tokens of the groups that arrived);
- ``g`` = the smallest x whose T is within ``tol`` of the best T seen: the knee estimate;
  ``b`` = the largest x below it (too few: T fell);
- no ``b`` yet: probe up when the limit binds and the engines report an empty queue (a raise
  takes effect at once; x ``max_factor``, or, when the actor waited, as far as Little's law says supplies a
  batch per training time), else probe down (``g / max_factor``);
- the curve still rises steeply at the largest x seen (elasticity dlnT/dlnx >= ``rise_elasticity``
  and the limit binds) and a raise would measure a new point: probe up;
- the curve rises up to the largest limit allowed (``g`` is the largest x and no raise is possible:
  the buffer bound, or a limit that made the engines queue): the local power law T ~ x^e between
  ``b`` and ``g`` says where T comes within ``tol`` of T(g): if that is within ``margin`` of ``g``
  settle at that largest limit, else move there (the measured CPU engine curve, tok/s(r) = peak x
  r / (r + c_half), has no knee before its slots fill: bisecting below a still-rising top only
  starves the engines, step after step);
- ``g / b`` wider than ``resolution`` (and an integer lies between): probe the geometric middle;
  else settle at ``g x (1 + margin)``;
- a step whose mean in-flight count is still above a lowered limit is not a point (the limit takes
  effect only as groups finish), nor is one that stays below the limit while neither limit held
  admission back (in-flight still ramping up); the first ``warmup_steps`` are not points either;
- engines queueing requests (``num_queue_reqs`` > ``queue_frac x num_running_reqs``) while they run
  as many as they ever did (within ``full_tol``: the slots are full; a queue while they run far fewer
  is requests waiting for their prefill) are past saturation: step down at once (the queued share, at most ``/ max_factor``), and no later probe
  goes above the limit that queued (until a retune). The step is a point of the curve too: when the
  lower limit measures less throughput (a bursty queue, e.g. a long tail of tool calls, can leave
  slots idle between bursts), the search settles back at the limit that queued. It need not wait for
  the drain (a long tail drains a lowered limit over several steps, each starving the engines): a
  draining step already measurably below the point that queued, with throughput down by elasticity
  ``>= bursty_elasticity`` (saturated engines lose none), settles back at once. Not a queue back-off
  on a step still draining a lowered limit;
- the step right after a change is no figure at all: after a raise its burst of admissions queues for
  a moment, not for good, and on real engines the figures lag (SGLang's ``gen_throughput`` is a
  trailing ~10 s window, and the actor reports it once per step, held until the next report), so
  that step still shows the old limit (on the CPU default, without this, every probe down read the
  previous limit's throughput and it probed on down to 1);
- settled, it holds (hysteresis): it searches again only when T at the settled limit moves by more
  than ``retune_frac`` (from the mean of the last ``REF_STEPS`` in-band steps) in the same direction
  for ``retune_steps`` steps in a row while the buffer limit does not bind (then training sets the
  pace), or the engines start queueing (a limit that queued when it was measured or in its first
  settled steps keeps that queue: a lower one lost throughput).
Every change is bounded (``limit / max_factor <= new <= limit x max_factor``), clamped to
``[lower, upper]`` (``upper`` = the buffer limit's bound, ``max_buffered_groups -
rollout_batch_size``) and returned as a ``Change`` with its reason (the core logs it and writes
``rollout/buffer/inflight_limit`` every step).

    tuner = InflightAutotuner(start=96, upper=224)  # figures without the actor's wait: the search alone
    step = StepFigures(limit=96, mean_inflight=95.2, tokens_per_s=8000.0, wait_inflight=0.9, wait_buffer=0.0)
    tuner.observe(step); tuner.observe(step)  # None: the first two steps are a warm-up
    change = tuner.observe(step)             # no engine figures, no point below: probe down
    change.new, change.reason                # 48, 'probe down: 8000 tok/s at 95.2 in flight, ...'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

REF_STEPS = 16  # held steps the settled reference throughput averages (long enough to average noise out)
TRAINING, GENERATION = "training", "generation"  # the side that set a step's pace (``binding_side``)
FED_FRAC = 0.03  # the actor waiting at most 3% of a step still runs at >= 97% of the rate training alone sets (the
# bar auto is held to); at 2% the Search-R1 simulation's derived limit read as starved on a noisy step now and then


def binding_side(wait_data_s: Optional[float], step_s: Optional[float], *, fed_frac: float = FED_FRAC) -> Optional[str]:
    """Which side set the pace of a step, from the broker's own clock: ``TRAINING`` when the actor waited at most
    ``fed_frac`` of the step for its batch (the batch was ready: generation has slack), else ``GENERATION``;
    None when the wait is not known. Step time alone cannot tell (a loaded machine slows both sides)."""
    if wait_data_s is None or not step_s or step_s <= 0:
        return None
    return TRAINING if wait_data_s <= fed_frac * step_s else GENERATION


@dataclass(frozen=True)
class StepFigures:
    """What one step showed (the core fills it at the hand-off)."""

    limit: int
    """The in-flight limit in effect during the step."""
    mean_inflight: float
    """Time-averaged in-flight groups over the step."""
    tokens_per_s: float
    """Generated tokens per second over the step (engines' gen_throughput, else counted by the broker)."""
    wait_inflight: float
    """rollout/buffer/admission_wait_inflight_limit of the step (fraction; the buffer had room)."""
    wait_buffer: float
    """rollout/buffer/admission_wait_buffer_full of the step (fraction; exclusive of ``wait_inflight``)."""
    running_reqs: Optional[float] = None
    """Requests running in all engines (SGLang ``num_running_reqs``, summed), when reported."""
    queue_reqs: Optional[float] = None
    """Requests queued in all engines (SGLang ``num_queue_reqs``, summed), when reported."""
    wait_data_s: Optional[float] = None
    """``time/wait_data``: seconds the actor waited for this step's batch (None: not known, the side is not told)."""
    step_s: Optional[float] = None
    """Seconds since the previous hand-off (``rollout/buffer/step_duration_s``)."""
    arrived_groups: Optional[float] = None
    """Groups that finished generating during the step."""
    trained_groups: Optional[int] = None
    """Groups handed to the actor at this hand-off (``rollout_batch_size``)."""
    surplus_groups: Optional[float] = None
    """Groups left in the buffer after the hand-off (made ahead of need: they wait a step and age)."""


def _supply(f: StepFigures) -> Optional[float]:
    """Little's law: the in-flight count that supplies a batch per training time (``step_s - wait_data_s``) at this
    step's group latency (``mean_inflight x step_s / arrived_groups``); None without the figures."""
    if not f.arrived_groups or not f.trained_groups or f.wait_data_s is None or not f.step_s:
        return None
    if f.step_s <= f.wait_data_s:
        return None
    return f.mean_inflight * f.trained_groups * f.step_s / (f.arrived_groups * (f.step_s - f.wait_data_s))


@dataclass(frozen=True)
class Change:
    old: int
    new: int
    reason: str


@dataclass
class AutotuneSettings:
    max_factor: float = 2.0
    """A change moves the limit by at most this factor (bounded step)."""
    tol: float = 0.02
    """A point is saturated when its throughput is within this fraction of the best seen."""
    resolution: float = 1.15
    """Stop bisecting when the saturated and the starved point are this close (ratio)."""
    margin: float = 0.1
    """Settle this far above the knee estimate (fluctuations of the in-flight count)."""
    rise_elasticity: float = 0.5
    """dlnT/dlnx at the largest point above which the curve still rises: probe up."""
    bursty_elasticity: float = 0.25
    """dlnT/dlnx above which a queue back-off that loses throughput while it drains goes back: engines that
    queued because their slots were full lose nothing from fewer groups in flight (0), a bursty queue does."""
    queue_frac: float = 0.15
    """Engines queueing more than this share of what they run are past saturation ..."""
    full_tol: float = 0.1
    """... when they run within this fraction of the most requests they ever ran (their slots are full)."""
    retune_frac: float = 0.25
    """Search again when the settled throughput moves by more than this ..."""
    retune_steps: int = 3
    """... for this many steps in a row."""
    warmup_steps: int = 2
    """Steps ignored at the start: the engines fill from empty, and real engines' figures lag a step (the
    second step's still describe the start-up: 0 tok/s read on the CPU default)."""
    ramp: float = 0.1
    """A step whose mean in-flight count stays this far below the limit while neither limit binds ..."""
    binds: float = 0.3
    """... (the two admission waits together under this fraction) is a ramp, not a point."""
    merge: float = 0.04
    """Points whose x differ by less than this fraction are one point (their T averaged)."""
    fed_frac: float = FED_FRAC
    """The actor waiting at most this share of a step for its batch: training set the pace (``binding_side``)."""
    fed_margin: float = 0.03
    """Training-bound: trim to this far above the in-flight count that supplies a batch a step (Little's law)."""
    drain_steps: float = 2.0
    """Training-bound: a surplus left in the buffer is drained over this many steps (at most half a batch a step) ..."""
    reserve: float = 0.1
    """... down to this share of a batch (slack against a slow step: drained to 0, the actor waits now and then)."""


@dataclass
class _Point:
    x: float
    t_sum: float
    n: int
    binds: bool
    queued: bool = False
    """The engines queued past ``queue_frac`` on a step of this point."""

    @property
    def t(self) -> float:
        return self.t_sum / self.n


@dataclass
class InflightAutotuner:
    start: int
    upper: int
    lower: int = 1
    settings: AutotuneSettings = field(default_factory=AutotuneSettings)

    def __post_init__(self):
        assert 1 <= self.lower <= self.upper, (self.lower, self.upper)
        self.limit = min(max(int(self.start), self.lower), self.upper)
        self.settled = False
        self.steps = 0
        self._points: list[_Point] = []
        self._settle_t = 0.0
        self._ref: list[float] = []
        self._off: list[float] = []
        self._ceiling = self.upper
        self._changed = False  # the last step changed the limit: the next one is not a figure
        self._max_running = 0.0  # the most requests the engines ran on a step so far
        self._queued_at_settle: Optional[bool] = None  # the engines queued at the settled limit
        self._backed_off: Optional[tuple[_Point, int]] = None  # the point and limit that queued, while it drains
        self._fed: Optional[int] = None  # the smallest limit at which training set the pace (since the last reset)
        self._starved = 0  # the largest limit below ``_fed`` at which the actor waited while the limit bound
        self._down_ok = True  # this step may lower the limit by the throughput search (not while the actor waits)
        self.side: Optional[str] = None
        """The side that set the last step's pace (``TRAINING``, ``GENERATION``; None: not told)."""
        self.history: list[Change] = []

    # ----------------------------------------------------------------- the one entry point
    def observe(self, f: StepFigures) -> Optional[Change]:
        """Take one step's figures; return the change of the limit it causes (or None)."""
        self.steps += 1
        if self.steps <= self.settings.warmup_steps or f.tokens_per_s <= 0 or f.mean_inflight <= 0:
            return None
        s = self.settings
        self.side = binding_side(f.wait_data_s, f.step_s, fed_frac=s.fed_frac)
        if self._changed:  # the step right after a change still shows the old limit: not a figure
            self._changed = False
            return None
        draining = f.mean_inflight > f.limit * (1 + s.merge)
        # generation sets the pace: with the in-flight limit binding, a lower limit can only make the actor wait longer
        # unless the engines are past saturation, which their queue shows; a throughput that reads flat at a lower
        # limit, measured at another time, may be a loaded machine (CPU contention), not over-admission
        self._down_ok = self.side != GENERATION
        if self.side == GENERATION and self._fed is not None and not draining and f.wait_inflight >= s.binds:
            return self._starved_at(f)
        self._max_running = max(self._max_running, f.running_reqs or 0.0)
        # queued while the engines run as many requests as they ever did: slots full. A queue while they run far
        # fewer than before is requests waiting for their prefill (the CPU engine's queue at 4 groups of 24 slots)
        queueing = (
            f.queue_reqs is not None
            and bool(f.running_reqs)
            and f.queue_reqs > s.queue_frac * f.running_reqs
            and f.running_reqs >= (1 - s.full_tol) * self._max_running
        )
        # a settled limit that already queued when it settled (measured: lower lost throughput) is kept
        if queueing and not draining and not (self.settled and self._queued_at_settle is not False):
            share = f.running_reqs / (f.running_reqs + f.queue_reqs)
            self.settled = False
            self._down_ok = True  # the engines' own evidence of over-admission
            point = self._add(f, queued=True)  # a point too: if the lower limit loses throughput, this one was needed
            change = self._move(
                min(self.limit - 1, math.floor(self.limit * share)),
                f"engines queue {f.queue_reqs:.0f} requests beyond the {f.running_reqs:.0f} they run: past saturation",
            )
            self._ceiling = f.limit  # no probe back up to the limit that made the engines queue
            self._backed_off = (point, f.limit) if change is not None else None
            return change
        if self.side == TRAINING:  # the engines have slack: trim toward the batch supply, never raise
            return None if draining else self._trim(f)
        if self.settled:
            return self._hold(f)
        if draining:  # a lowered limit takes effect only as groups finish: measure once it has, unless ...
            return self._bursty_queue(f)  # ... a queue back-off already loses throughput on the way down
        self._backed_off = None
        if f.mean_inflight < f.limit * (1 - s.ramp) and f.wait_inflight + f.wait_buffer < s.binds:
            return None  # neither limit held admission back: in-flight still ramping up, not a point of the curve
        self._add(f)
        return self._search(f)

    # ----------------------------------------------------------------- internals
    def _add(self, f: StepFigures, queued: bool = False) -> _Point:
        binds = f.wait_inflight >= self.settings.binds
        for p in self._points:
            if abs(p.x - f.mean_inflight) <= self.settings.merge * max(p.x, f.mean_inflight):
                p.t_sum += f.tokens_per_s
                p.n += 1
                p.binds = binds
                p.queued = p.queued or queued
                return p
        self._points.append(_Point(f.mean_inflight, f.tokens_per_s, 1, binds, queued))
        return self._points[-1]

    def _bursty_queue(self, f: StepFigures) -> Optional[Change]:
        """A step draining a queue back-off, already measurably below the point that queued: if throughput
        fell with the in-flight count (elasticity >= ``bursty_elasticity``; saturated engines lose none), the queue
        was bursty (a long tail of tool calls leaves slots idle between bursts),
        not saturation: settle back at the limit that queued now, not after the drain (with a long tail the
        drain takes several steps, each starving the engines)."""
        if self._backed_off is None:
            return None
        q, queued_limit = self._backed_off
        s = self.settings
        if f.mean_inflight >= q.x * (1 - s.merge):
            return None  # not yet a different point
        e = math.log(q.t / f.tokens_per_s) / math.log(q.x / f.mean_inflight)
        if e < s.bursty_elasticity:
            return None  # about flat: the queue meant saturation, the back-off goes on
        self._backed_off = None
        why = (
            f"{f.tokens_per_s:.0f} tok/s at {f.mean_inflight:.1f} in flight while the back-off drains "
            f"(elasticity {e:.2f}): the queue at {queued_limit} is bursty, not saturation; "
        )
        return self._settle(q, self._add(f), queued_limit, why)

    def _trim(self, f: StepFigures) -> Optional[Change]:
        """Training set the pace: never raise; lower toward the in-flight count that supplies a batch a step.
        Little's law: ``mean_inflight = arrival rate x group latency``, so at this step's latency a batch a step
        (``trained_groups``) takes ``mean_inflight x trained / arrived`` groups in flight (the buffer limit binds
        while more arrive than training takes); ``fed_margin`` above it, never below a limit that starved."""
        s = self.settings
        if not f.arrived_groups or not f.trained_groups:
            return None
        if self._fed is None or f.arrived_groups >= f.trained_groups:  # this limit's own generation supplied a batch
            self._fed = f.limit if self._fed is None else min(self._fed, f.limit)
        surplus = f.surplus_groups or 0.0
        drain = max(0.0, surplus - s.reserve * f.trained_groups) / s.drain_steps
        want = max(f.trained_groups - drain, f.trained_groups / 2)  # arrivals the next step needs
        need = f.mean_inflight * want / f.arrived_groups
        target = max(need * (1 + s.fed_margin), self._starved + 1)
        if target >= f.limit * (1 - s.merge):
            return None  # holds: about what a batch a step takes
        self.settled = False
        return self._move(
            target,
            f"training sets the pace (the actor waited {f.wait_data_s:.2f} s of a {f.step_s:.1f} s step, the buffer "
            f"limit bound {f.wait_buffer:.0%} of it): {f.arrived_groups:.0f} groups arrived at {f.mean_inflight:.1f} "
            f"in flight and {surplus:.0f} are left over, {need:.1f} supply the {want:.0f} a batch of "
            f"{f.trained_groups} still needs",
        )

    def _starved_at(self, f: StepFigures) -> Optional[Change]:
        """The actor waited while the in-flight limit bound, after training had set the pace: up to the in-flight
        count that supplies a batch per training time, ``step_s - wait_data_s`` (Little's law, ``fed_margin`` above),
        at least one more. Below the limit that fed it (a trim went too far, or drained the surplus): at most back
        to that limit, and never again down to this one. At or above it (generation got slower): once; then the
        search takes over (its raises, the engines' queue)."""
        assert self._fed is not None and f.wait_data_s is not None and f.step_s is not None
        s = self.settings
        fed = self._fed
        if f.limit < fed:
            self._starved = max(self._starved, f.limit)
        else:
            self._fed, self._starved = None, 0
        need = _supply(f)
        if need is None:
            return None
        target = max(need * (1 + s.fed_margin), f.limit + 1)
        return self._move(
            min(target, fed) if f.limit < fed else target,
            f"generation sets the pace (the actor waited {f.wait_data_s:.2f} s of a {f.step_s:.1f} s step while the "
            f"in-flight limit bound {f.wait_inflight:.0%} of it): {f.arrived_groups:.0f} groups arrived at "
            f"{f.mean_inflight:.1f} in flight, {need:.1f} supply a batch of {f.trained_groups} per "
            f"{f.step_s - f.wait_data_s:.1f} s of training",
        )

    def _forget(self) -> None:
        self._points = []
        self.settled = False
        self._off = []
        self._ceiling = self.upper
        self._backed_off = None

    def _knee(self) -> tuple[_Point, Optional[_Point]]:
        best = max(p.t for p in self._points)
        good = [p for p in self._points if p.t >= (1 - self.settings.tol) * best]
        g = min(good, key=lambda p: p.x)
        below = [p for p in self._points if p.x < g.x]
        return g, (max(below, key=lambda p: p.x) if below else None)

    def _search(self, f: StepFigures) -> Optional[Change]:
        s = self.settings
        g, b = self._knee()
        top = max(self._points, key=lambda p: p.x)
        rising = (
            b is not None
            and g is top
            and g.binds
            and f.wait_buffer < s.binds
            and math.log(g.t / max(b.t, 1e-9)) / math.log(g.x / b.x) >= s.rise_elasticity
        )
        idle = f.queue_reqs is not None and f.queue_reqs <= 0.02 * (f.running_reqs or 0.0)
        if b is None and g is top and idle and g.binds and f.wait_buffer < s.binds and self.limit < self._ceiling:
            # the actor waited: as far as Little's law says supplies a batch per training time (a step that waited
            # 3% of it asks for ~3% more, not twice as many); unknown wait: twice
            need = _supply(f) if self.side == GENERATION else None
            up = g.x * s.max_factor if need is None else max(need * (1 + s.fed_margin), g.x * (1 + s.merge))
            return self._move(
                min(up, g.x * s.max_factor, self._ceiling),
                f"probe up: the limit binds at {g.x:.1f} in flight and the engines queue nothing"
                + ("" if need is None else f"; {need:.1f} in flight supply a batch per training time"),
            )
        if b is None and g.x > self.lower and self.limit > self.lower:
            return self._move(
                g.x / s.max_factor, f"probe down: {g.t:.0f} tok/s at {g.x:.1f} in flight, none below it measured yet"
            )
        room = min(g.x * s.max_factor, self._ceiling) > g.x * (1 + s.merge)  # a raise would measure a new point
        if rising and room:
            return self._move(
                min(g.x * s.max_factor, self._ceiling),
                f"probe up: throughput still rises at {g.x:.1f} in flight ({b.t:.0f} -> {g.t:.0f} tok/s)",
            )
        if b is not None and g is top and not room:
            # the curve rises up to the largest limit allowed: the smallest limit within tol of it, read off the
            # local power law T ~ x^e between b and g (the measured engine curve has no knee, only a slope)
            e = math.log(g.t / max(b.t, 1e-9)) / math.log(g.x / b.x)
            est = g.x * (1 - s.tol) ** (1 / e) if e > 0 else b.x
            if est * (1 + s.margin) >= g.x:
                return self._settle(
                    g, b, self._ceiling, f"the curve still rises at the bound {self._ceiling} (elasticity {e:.2f}); "
                )
            if b.x < math.ceil(est) < g.x:
                return self._move(
                    est,
                    f"interpolate: {b.t:.0f} tok/s at {b.x:.1f}, {g.t:.0f} at {g.x:.1f} in flight "
                    f"(elasticity {e:.2f}): within {s.tol:.0%} of it from {est:.1f}",
                )
        if b is not None and g.x / b.x > s.resolution and b.x < math.ceil(math.sqrt(g.x * b.x)) < g.x:
            return self._move(
                math.sqrt(g.x * b.x),
                f"bisect: saturated at {g.x:.1f} ({g.t:.0f} tok/s), starved at {b.x:.1f} ({b.t:.0f} tok/s)",
            )
        return self._settle(g, b, g.x * (1 + s.margin), "")

    def _settle(self, g: _Point, b: Optional[_Point], target: float, why: str) -> Optional[Change]:
        self.settled = True
        self._settle_t = 0.0
        self._ref = []
        self._queued_at_settle = g.queued or None  # its queue was measured with its throughput
        why = f"settle: {why}the smallest saturated point is {g.x:.1f} in flight ({g.t:.0f} tok/s)"
        if b is not None:
            why += f"; {b.x:.1f} gave {b.t:.0f} tok/s"
        return self._move(min(target, self._ceiling), why)

    def _hold(self, f: StepFigures) -> Optional[Change]:
        s = self.settings
        if len(self._ref) < s.retune_steps:  # the reference: the mean of the first steps at the settled limit
            self._ref.append(f.tokens_per_s)
            self._settle_t = sum(self._ref) / len(self._ref)
            q = f.queue_reqs is not None and bool(f.running_reqs) and f.queue_reqs > s.queue_frac * f.running_reqs
            self._queued_at_settle = bool(self._queued_at_settle) or q
            return None
        if f.wait_buffer >= s.binds:  # training sets the pace: throughput moves say nothing about the engines
            self._off = []
            return None
        dev = f.tokens_per_s / self._settle_t - 1
        self._off = self._off + [dev] if abs(dev) > s.retune_frac and (not self._off or dev * self._off[0] > 0) else []
        if not self._off:  # an in-band step refines the reference (a running mean: one noisy first step
            self._ref = (self._ref + [f.tokens_per_s])[-REF_STEPS:]  # must not set it for good)
            self._settle_t = sum(self._ref) / len(self._ref)
        if len(self._off) < s.retune_steps:
            return None
        old = self._settle_t
        self._forget()
        self._add(f)
        change = self._search(f)
        reason = f"retune: throughput moved from {old:.0f} to {f.tokens_per_s:.0f} tok/s at the settled limit"
        if change is None:
            return None
        self.history[-1] = Change(change.old, change.new, f"{reason}; {change.reason}")
        return self.history[-1]

    def _move(self, target: float, reason: str) -> Optional[Change]:
        s = self.settings
        new = math.ceil(target - 1e-9)
        new = max(new, math.floor(self.limit / s.max_factor), self.lower)
        new = min(new, math.ceil(self.limit * s.max_factor), self.upper)
        if new == self.limit or (new < self.limit and not self._down_ok):
            return None
        change = Change(self.limit, new, reason)
        self._changed = True
        self.limit = new
        self.history.append(change)
        return change
