"""The in-flight autotuner's decisions (asyncrl/broker/autotune.py) and its wiring into the broker core.

The controller is fed the figures a step would show for an engine curve T(x) = peak x min(x, knee) / knee
(flat past saturation, as SGLang's throughput is once the batch is compute-bound), and, in the later
tests, for the curve measured on the CPU engine, T(x) = peak x x / (x + c_half) (no knee, a slope that
shrinks); the mean in-flight count of a step is the limit in force (the limit binds when generation is
the bottleneck).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np

from asyncrl.broker.autotune import InflightAutotuner, StepFigures
from asyncrl.broker.core import BrokerCore, CoreSettings
from asyncrl.broker.types import PromptItem, Trajectory


def _figures(
    limit: int, knee: float, *, peak: float = 5000.0, noise: float = 0.0, rng=None, queue: bool = False
) -> StepFigures:
    t = peak * min(limit, knee) / knee * (1 + (rng.uniform(-noise, noise) if rng else 0.0))
    running = queued = None
    if queue:  # engines run at most 2 x knee requests per in-flight group's worth; the rest queue
        running, queued = min(limit, 2 * knee), max(0.0, limit - 2 * knee)
    return StepFigures(
        limit=limit,
        mean_inflight=float(limit),
        tokens_per_s=t,
        wait_inflight=1.0,
        wait_buffer=0.0,
        running_reqs=running,
        queue_reqs=queued,
    )


def _run(tuner: InflightAutotuner, knee: float, steps: int, **kw) -> list[int]:
    limits = []
    for _ in range(steps):
        tuner.observe(_figures(tuner.limit, knee, **kw))
        limits.append(tuner.limit)
    return limits


def test_backs_off_from_an_oversized_limit_to_the_knee():
    tuner = InflightAutotuner(start=96, upper=200)
    limits = _run(tuner, knee=20, steps=24)  # each change: one step without figures, then its own
    assert tuner.settled
    assert 20 <= tuner.limit <= math.ceil(20 * 1.15 * 1.05), limits
    assert limits[-3:] == [tuner.limit] * 3
    assert all(c.new < c.old or c.reason.startswith(("bisect", "settle")) for c in tuner.history)
    assert tuner.history[0].reason.startswith("probe down")


def test_climbs_to_saturate_engines_starved_by_a_small_limit():
    tuner = InflightAutotuner(start=4, upper=200)
    limits = _run(tuner, knee=50, steps=28)
    assert tuner.settled and 50 <= tuner.limit <= math.ceil(50 * 1.15 * 1.05), limits
    assert any(c.reason.startswith("probe up") for c in tuner.history)


def test_every_change_is_bounded_and_within_the_buffer_bound():
    tuner = InflightAutotuner(start=300, upper=40)  # start clamps to the buffer limit's bound
    assert tuner.limit == 40
    prev = tuner.limit
    for _ in range(15):
        tuner.observe(_figures(tuner.limit, knee=500))  # engines never saturate: it wants more
        assert 1 <= tuner.limit <= 40
        assert prev / 2 - 1 <= tuner.limit <= prev * 2 + 1
        prev = tuner.limit
    assert tuner.limit == 40


def test_holds_under_noise_once_settled():
    rng = random.Random(0)
    tuner = InflightAutotuner(start=64, upper=200)
    _run(tuner, knee=16, steps=20, noise=0.02, rng=rng)
    assert tuner.settled
    settled = tuner.limit
    n_changes = len(tuner.history)
    _run(tuner, knee=16, steps=40, noise=0.08, rng=rng)  # +-8% step-to-step noise: no oscillation
    assert tuner.limit == settled and len(tuner.history) == n_changes


def test_retunes_when_the_workload_changes():
    tuner = InflightAutotuner(start=64, upper=400)
    _run(tuner, knee=16, steps=24)
    assert tuner.settled and tuner.limit < 24
    _run(tuner, knee=80, steps=32)  # e.g. longer tool calls: more groups needed in flight
    assert tuner.limit >= 80 and any(c.reason.startswith("retune") for c in tuner.history)


def test_engine_queue_backs_off_at_once():
    tuner = InflightAutotuner(start=100, upper=200)
    for _ in range(2):  # the two warm-up steps: ignored
        tuner.observe(_figures(100, knee=10, queue=True))
    change = tuner.observe(_figures(100, knee=10, queue=True))
    assert change is not None and change.new == 50 and "queue" in change.reason  # bounded: at most / 2


def test_core_logs_the_limit_and_tunes_it_down():
    """The core with ``inflight_autotune``: a generation-bound toy where throughput saturates at 6 groups (the
    engines' 6 slots: more queue, and the queue is what lowers the limit while the actor waits for data)."""
    now = [0.0]
    core = BrokerCore(
        [PromptItem(i, f"q{i}") for i in range(64)],
        clock=lambda: now[0],
        settings=CoreSettings(
            rollout_batch_size=4,
            group_size=1,
            max_inflight_groups=24,
            max_buffered_groups=28,
            max_dropped_groups_per_step=40,
            inflight_autotune=True,
        ),
    )
    core.add_worker("w", capacity=100)
    limits = []
    for step in range(14):
        core.request_batch(step)
        while (batch := core.take_batch()) is None:
            gids = core.inflight_group_ids()
            rate = min(len(gids), 6) / len(gids)  # each group's share of a saturating engine
            now[0] += 1.0 / rate
            running = min(len(gids), 6)
            core.engine_figures(running_reqs=running, queue_reqs=len(gids) - running, gen_tokens_per_s=100 * running)
            core.group_finished(gids[0], [Trajectory([0], [1], [1], [0.0])])
        limits.append(batch.metrics["rollout/buffer/inflight_limit"])
    assert limits[0] == 24 and 6 <= core.inflight_limit <= 9, limits


def test_config_accepts_auto_and_starts_at_the_derived_limit():
    from asyncrl.config import ConfigError, load_config, validate
    from asyncrl.config.render import render_config

    tiny = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.toml")
    cfg = load_config(tiny, ['rollout_buffer.max_inflight_groups="auto"'])
    validate(cfg, world_size=2)
    assert cfg.rollout_buffer.max_inflight_groups == "auto"
    s = CoreSettings.from_config(cfg)
    assert s.inflight_autotune and s.max_inflight_groups == 8  # ceil(24 x 1 x 1.2 / 4), within [1, 16 - 8]
    assert 'max_inflight_groups = "auto"  # tuned by the broker: starts at 8, within [1, 8]' in render_config(cfg)
    fixed = CoreSettings.from_config(load_config(tiny, ["rollout_buffer.max_inflight_groups=5"]))
    assert not fixed.inflight_autotune and fixed.max_inflight_groups == 5
    for bad, key in (('"fast"', "expected int or 'auto'"), ("0", "> 0")):
        try:
            load_config(tiny, [f"rollout_buffer.max_inflight_groups={bad}"])
        except ConfigError as e:
            assert "rollout_buffer.max_inflight_groups" in str(e) and key in str(e)
        else:
            raise AssertionError(f"{bad} accepted")
    cramped = load_config(tiny, ['rollout_buffer.max_inflight_groups="auto"', "rollout_buffer.max_buffered_groups=8"])
    try:
        validate(cramped, world_size=2)
    except ConfigError as e:
        assert "rollout_buffer.max_inflight_groups" in str(e) and "max_buffered_groups" in str(e)
    else:
        raise AssertionError("auto with no room accepted")


def test_event_simulator_drives_the_core_with_auto_within_bounds():
    from asyncrl.simulate import EngineModel, SimConfig, Workload, simulate

    cfg = SimConfig(
        engines=4,
        batch=8,
        buffered=8 + 40,
        inflight="auto",
        steps=14,
        engine=EngineModel(peak_tok_s=4000.0, c_half=8.0, max_running=16),
    )
    r = simulate(cfg, Workload(train_s=0.1, sync_s=0.05))
    assert len(r.metrics) == 14 and r.limits[0] == 20  # derived: ceil(16 x 4 x 1.2 / 4) = 20 (bound 40)
    assert all(1 <= n <= 40 for n in r.limits)
    assert all(b <= 2 * a + 1 and a <= 2 * b + 1 for a, b in zip(r.limits, r.limits[1:]))  # bounded steps
    assert r.changes and r.throughput_groups_s() > 0


# --------------------------------------------------------------------- the measured engine curve
# benchmarks/engine_curve.py measured the CPU engine: tok/s(r) = peak x r / (r + c_half), no knee
# before its slots fill (asyncrl.simulate.fit_saturation). The figures below follow that curve.
def _smooth(limit: int, *, c_half: float, peak: float = 5000.0, queued: float = 0.0, mean=None) -> StepFigures:
    x = float(limit if mean is None else mean)
    return StepFigures(
        limit=limit,
        mean_inflight=x,
        tokens_per_s=peak * x / (x + c_half),
        wait_inflight=1.0,
        wait_buffer=0.0,
        running_reqs=4 * x,
        queue_reqs=queued,
    )


def test_settles_at_the_bound_when_the_curve_still_rises_there():
    """A still-rising top at the buffer bound: one probe down, then settle at the bound (no bisecting
    below a rising curve, no 'probe up' back to the point already measured at the bound)."""
    tuner = InflightAutotuner(start=40, upper=40)
    for _ in range(8):
        tuner.observe(_smooth(tuner.limit, c_half=16))
    assert tuner.settled and tuner.limit == 40
    assert [c.reason.split(":")[0] for c in tuner.history] == ["probe down", "settle"], tuner.history
    assert "still rises at the bound" in tuner.history[-1].reason


def test_interpolates_on_the_power_law_when_the_top_is_nearly_flat():
    """Top at the bound, the curve nearly flat between b and g: move to where the local power law is within
    tol of the top instead of halving the bracket."""
    tuner = InflightAutotuner(start=40, upper=40)
    for _ in range(2):  # the two warm-up steps: ignored
        tuner.observe(_smooth(40, c_half=2))
    assert tuner.observe(_smooth(40, c_half=2)).new == 20  # probe down
    assert tuner.observe(_smooth(20, c_half=2)) is None  # the step right after a change: no figure
    change = tuner.observe(_smooth(20, c_half=2))  # T(20)/T(40) = 0.95: elasticity 0.07
    assert change is not None and change.reason.startswith("interpolate") and 20 < change.new < 40
    e = math.log((40 / 42) / (20 / 22)) / math.log(2)
    assert change.new == math.ceil(40 * 0.98 ** (1 / e))


def test_queue_after_a_raise_or_while_draining_is_not_a_back_off():
    tuner = InflightAutotuner(start=20, upper=80)
    for _ in range(2):  # the two warm-up steps: ignored
        tuner.observe(_smooth(20, c_half=100))
    assert tuner.observe(_smooth(20, c_half=100)).new == 40  # probe up: binds, engines queue nothing
    burst = tuner.observe(_smooth(40, c_half=10, queued=80.0))  # the raise's burst: 160 running, 80 queued
    assert burst is None or "queue" not in burst.reason
    tuner.settled, tuner._raised = False, False  # the same queue on a later step at that limit: back off
    steady = tuner.observe(_smooth(tuner.limit, c_half=10, queued=80.0))
    assert steady is not None and "queue" in steady.reason
    tuner2 = InflightAutotuner(start=40, upper=80)
    tuner2.observe(_smooth(40, c_half=10))
    tuner2.limit = 20  # as if just lowered: the step still drains (mean 38 in flight)
    assert tuner2.observe(_smooth(20, c_half=10, mean=38.0, queued=100.0)) is None and tuner2.limit == 20


def test_a_queue_back_off_can_come_back_up_to_below_the_limit_that_queued():
    tuner = InflightAutotuner(start=64, upper=64)
    for _ in range(2):  # the two warm-up steps: ignored
        tuner.observe(_smooth(64, c_half=16, queued=128.0))
    change = tuner.observe(_smooth(64, c_half=16, queued=128.0))  # 256 running, 128 queued: share 2/3
    assert change.new == 42 and "queue" in change.reason
    assert tuner._ceiling == 64  # the limit that queued, not the lowered one


def _settle(tuner: InflightAutotuner, **kw) -> None:
    """Feed the curve until it settles, then the figure-less step after the settling change."""
    for _ in range(12):
        tuner.observe(_smooth(tuner.limit, **kw))
        if tuner.settled:
            break
    assert tuner.settled
    tuner.observe(_smooth(tuner.limit, **kw))


def test_a_limit_that_queued_when_it_settled_is_kept():
    """Settled where the engines already queued (a lower limit measured less throughput): that queue is
    known, not a reason to back off; a queue that starts later is."""
    tuner = InflightAutotuner(start=40, upper=40)
    _settle(tuner, c_half=16)
    assert tuner.limit == 40
    for _ in range(10):
        tuner.observe(_smooth(40, c_half=16, queued=40.0))  # 160 running, 40 queued: 25% (> queue_frac)
    assert tuner.limit == 40 and tuner.settled
    fresh = InflightAutotuner(start=40, upper=40)
    _settle(fresh, c_half=16)
    for _ in range(3):  # the reference steps at the settled limit: no queue
        fresh.observe(_smooth(40, c_half=16))
    change = fresh.observe(_smooth(40, c_half=16, queued=40.0))
    assert change is not None and "queue" in change.reason


def test_a_noisy_first_reference_step_does_not_trigger_a_retune():
    tuner = InflightAutotuner(start=40, upper=40)
    while not tuner.settled:
        tuner.observe(_smooth(tuner.limit, c_half=16))
    n = len(tuner.history)
    base = _smooth(40, c_half=16).tokens_per_s
    rng = random.Random(1)
    for k in range(60):  # the first steps read 20% low (a noisy start); the in-band ones after refine the reference
        t = base * (0.8 if k < 4 else 1 + rng.uniform(-0.1, 0.1))
        tuner.observe(StepFigures(limit=40, mean_inflight=40.0, tokens_per_s=t, wait_inflight=1.0, wait_buffer=0.0))
    assert len(tuner.history) == n and tuner.limit == 40


def test_lagging_figures_do_not_walk_it_down():
    """The real engines' figures lag a step (a trailing ~10 s gen_throughput, reported once per step): the
    step after a change still shows the old limit's throughput. Read as the new limit's, every probe down
    looks free and it walks down to 1 (seen on the CPU default); the step after a change is no figure."""
    tuner = InflightAutotuner(start=8, upper=8)
    prev = 8
    for _ in range(16):
        f = _smooth(tuner.limit, c_half=16)
        lagged = StepFigures(
            limit=f.limit,
            mean_inflight=f.mean_inflight,
            tokens_per_s=_smooth(prev, c_half=16).tokens_per_s,
            wait_inflight=1.0,
            wait_buffer=0.0,
        )
        prev = tuner.limit
        tuner.observe(lagged)
    assert tuner.settled and tuner.limit == 8 and min(c.new for c in tuner.history) >= 4, tuner.history


def test_a_queue_while_the_engines_run_fewer_than_before_is_not_saturation():
    """The CPU default's broker log: "4 -> 3: engines queue 3 requests beyond the 16 they run", then 7, then 3 -
    requests waiting for their prefill on an engine with 24 slots, read as saturation step after step. A queue
    counts only while the engines run as many requests as they ever did."""
    tuner = InflightAutotuner(start=8, upper=8)
    figures = {8: (32.0, 6.0, 400.0), 4: (16.0, 3.0, 390.0), 3: (12.0, 3.0, 300.0)}  # running, queued, tok/s
    for _ in range(12):
        running, queued, t = figures.get(tuner.limit, (4.0 * tuner.limit, 1.0, 100.0 * tuner.limit))
        tuner.observe(
            StepFigures(
                limit=tuner.limit,
                mean_inflight=float(tuner.limit),
                tokens_per_s=t,
                wait_inflight=1.0,
                wait_buffer=0.0,
                running_reqs=running,
                queue_reqs=queued,
            )
        )
    assert tuner.limit >= 4 and not any("queue" in c.reason for c in tuner.history if c.old < 8), tuner.history


def _tail_step(limit: int, mean: float, tok_s: float, *, queued: float = 0.0) -> StepFigures:
    """A step of the multi-turn long-tail shape at 32 engines (24 slots each: 768 running when full)."""
    return StepFigures(
        limit=limit,
        mean_inflight=mean,
        tokens_per_s=tok_s,
        wait_inflight=1.0,
        wait_buffer=0.0,
        running_reqs=768.0 if queued else 0.8 * mean * 4,
        queue_reqs=queued,
    )


def test_a_bursty_queue_back_off_comes_back_while_it_drains():
    """The long-tail shape (benchmarks/simulate.py D, 32 engines, seed 1): at the buffer bound 462 the engines
    queue in bursts and the back-off to 303 drains over five steps (groups with slow tool calls finish late);
    the first draining step already loses throughput on a rising slope (elasticity 0.51), so it goes back to
    462 there (settled by step 7), not once the drain is over (step 11 with the old rule: past the 10 steps)."""
    tuner = InflightAutotuner(start=231, upper=462)
    for _ in range(3):  # two warm-up steps, then the limit binds with no queue: probe up
        change = tuner.observe(_tail_step(231, 231.0, 52000.0))
    assert change.new == 462 and change.reason.startswith("probe up")
    assert tuner.observe(_tail_step(462, 462.0, 74000.0, queued=500.0)) is None  # the raise's burst: no figure
    back_off = tuner.observe(_tail_step(462, 462.0, 75216.0, queued=400.0))
    assert back_off.new == 303 and "queue" in back_off.reason
    assert tuner.observe(_tail_step(303, 446.1, 74000.0)) is None  # right after a change: no figure
    back = tuner.observe(_tail_step(303, 412.3, 70951.0))  # still draining, throughput down by elasticity 0.51
    assert back is not None and back.new == 462 and "bursty" in back.reason, tuner.history
    assert tuner.settled
    for _ in range(6):  # it holds there, the bursty queue included (it queued when it settled)
        assert tuner.observe(_tail_step(462, 462.0, 75000.0, queued=400.0)) is None
    assert tuner.limit == 462


def test_a_saturated_queue_back_off_drains_on():
    """The same back-off when the engines' slots were full for good: the draining steps lose no throughput
    (the queue, not the slots, shrinks), so it keeps the lowered limit and measures it once drained."""
    tuner = InflightAutotuner(start=231, upper=462)
    for _ in range(3):
        tuner.observe(_tail_step(231, 231.0, 52000.0))
    tuner.observe(_tail_step(462, 462.0, 75000.0, queued=500.0))
    assert tuner.observe(_tail_step(462, 462.0, 75216.0, queued=400.0)).new == 303
    tuner.observe(_tail_step(303, 446.1, 75200.0))
    for mean in (412.3, 383.7, 350.1):
        assert tuner.observe(_tail_step(303, mean, 75100.0)) is None and tuner.limit == 303


def test_arrived_tokens_count_a_long_uint8_mask_without_overflow():
    """The wire decodes ``loss_mask`` as uint8 arrays: the autotuner's fallback token count (engines that report
    nothing) must count 300 generated tokens as 300 (a plain ``sum`` over uint8 wraps to 44)."""
    core = BrokerCore(
        [PromptItem(i, f"q{i}") for i in range(8)],
        clock=lambda: 0.0,
        settings=CoreSettings(
            rollout_batch_size=2,
            group_size=1,
            max_inflight_groups=2,
            max_buffered_groups=4,
            max_dropped_groups_per_step=8,
            inflight_autotune=True,
        ),
    )
    core.add_worker("w", capacity=8)
    n = 300
    mask = np.ones(n, np.uint8)
    traj = Trajectory(np.zeros(3, np.int32), np.ones(n, np.int32), mask, np.zeros(n, np.float32))
    core.group_finished(core.inflight_group_ids()[0], [traj])
    assert core._meter.arrived_tokens == n
