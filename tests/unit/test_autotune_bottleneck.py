"""The in-flight autotuner knows the bottleneck (issue 42, item 2): which side set a step's pace is read off the
broker's own clock (did the actor wait for its batch?), and it decides differently on each side.

- Training sets the pace (Search-R1's config in the simulator: the buffer limit binds, ``time/wait_data`` ~ 0): it
  never raises the limit, and lowers it toward the in-flight count that supplies a batch a step.
- Generation sets the pace (the actor waits): a lower limit can only make it wait longer unless the engines are past
  saturation, which their queue shows; a throughput that reads flat at a lower limit may be a loaded machine (the
  CPU default at load 6.5 went 8 -> 2-3 and ran at 0.73x), so without a queue it does not go down.
"""

from __future__ import annotations

import logging
import random
from dataclasses import replace
from pathlib import Path

from asyncrl.broker.autotune import GENERATION, TRAINING, InflightAutotuner, StepFigures, binding_side

REPO = Path(__file__).resolve().parents[2]
STEP_S = 85.2  # Search-R1: train 85 s + sync 0.2 s
BATCH = 512
SUPPLY = 300.0  # groups in flight that generate a batch per step (at the group latency of the toy below)


def _training_step(limit: int) -> StepFigures:
    """A Search-R1-shaped step: above SUPPLY in flight the buffer fills and its limit binds (the mean in-flight count
    is what generation needs, Little's law); below it the actor waits and fewer groups arrive."""
    x = min(float(limit), SUPPLY)
    short = max(0.0, SUPPLY / limit - 1.0)
    return StepFigures(
        limit=limit,
        mean_inflight=x,
        tokens_per_s=400.0 * x,
        wait_inflight=1.0 if limit <= SUPPLY else SUPPLY / limit,
        wait_buffer=0.0 if limit <= SUPPLY else 1.0 - SUPPLY / limit,
        running_reqs=3.0 * x,
        queue_reqs=0.0,
        wait_data_s=STEP_S * short,
        step_s=STEP_S * (1 + short),
        arrived_groups=BATCH * min(1.0, limit / SUPPLY),
        trained_groups=BATCH,
    )


def test_the_side_is_the_actors_wait_not_the_step_time():
    assert binding_side(0.0, 85.2) == TRAINING
    assert binding_side(1.0, 85.2) == TRAINING  # 1.2% of the step: the batch was as good as ready
    assert binding_side(1.1, 2.33) == GENERATION  # the loaded CPU default: the actor waited half the step
    assert binding_side(None, 2.0) is None and binding_side(0.0, 0.0) is None


def test_training_bound_never_raises_where_the_limit_binds_and_engines_idle():
    """The issue's case: at the derived 308 the in-flight limit binds and the engines queue nothing, but the actor
    never waits; the old tuner probed up 308 -> 512 (same throughput, staleness 1.63 -> 2.00)."""
    tuner = InflightAutotuner(start=308, upper=512)
    for _ in range(12):
        f = _training_step(tuner.limit)
        f = replace(f, mean_inflight=float(tuner.limit), wait_inflight=1.0, wait_buffer=0.0, arrived_groups=BATCH)
        tuner.observe(f)
        assert tuner.limit <= 308, tuner.history
    assert tuner.side == TRAINING and tuner.history == []


def test_training_bound_trims_an_oversized_limit_toward_the_batch_supply():
    tuner = InflightAutotuner(start=512, upper=512)
    limits = []
    for _ in range(14):
        tuner.observe(_training_step(tuner.limit))
        limits.append(tuner.limit)
    assert all(b <= a for a, b in zip(limits, limits[1:])), limits  # never up
    assert SUPPLY <= tuner.limit <= SUPPLY * 1.04 + 1, limits  # fed_margin above the supply
    assert tuner.history and all(c.reason.startswith("training sets the pace") for c in tuner.history)
    assert limits[-4:] == [tuner.limit] * 4


def test_a_trim_that_starves_the_actor_backs_up_and_stays_above():
    tuner = InflightAutotuner(start=400, upper=512)
    for _ in range(2):  # warm-up
        tuner.observe(_training_step(400))
    # a step that says twice the batch arrived (a burst): the trim overshoots to 200 (bounded: at most / 2)
    change = tuner.observe(replace(_training_step(400), arrived_groups=2.0 * BATCH))
    assert change is not None and change.new == 200
    tuner.observe(_training_step(200))  # the step right after a change: no figure
    back = tuner.observe(_training_step(200))  # the actor waits half the step while the limit binds
    assert (
        tuner.side == GENERATION and back is not None and back.new > 200 and "generation sets the pace" in back.reason
    )
    for _ in range(12):
        tuner.observe(_training_step(tuner.limit))
        assert tuner.limit > 200  # never again down to a limit that starved the actor
    assert SUPPLY <= tuner.limit <= 400


def test_a_surplus_in_the_buffer_is_drained_then_the_supply_restored():
    """Groups left over after the hand-off age a step in the buffer: it supplies less until they are down to a tenth
    of a batch (below the supply: the buffer makes up the rest), and when the actor then waits it goes back up to what
    Little's law says supplies a batch per training time, not above the limit that fed it."""
    tuner = InflightAutotuner(start=300, upper=512)
    for _ in range(2):  # warm-up
        tuner.observe(_training_step(300))
    drain = tuner.observe(replace(_training_step(300), surplus_groups=0.6 * BATCH))  # 307 left over
    want = BATCH - (0.6 - 0.1) * BATCH / 2  # drained over 2 steps, down to a tenth of a batch
    assert drain is not None and drain.new == round(300 * want / BATCH * 1.03 + 0.5) and "left over" in drain.reason
    low = tuner.limit
    tuner.observe(_training_step(low))  # the step right after a change: no figure
    back = tuner.observe(_training_step(low))  # the surplus is gone: the actor waits while the limit binds
    assert back is not None and back.new == 300 and "generation sets the pace" in back.reason  # capped at the fed 300
    assert tuner._starved == low


def _loaded_cpu_step(limit: int, rng: random.Random, *, queue: bool = False) -> StepFigures:
    """The CPU default on a loaded machine: the in-flight limit binds, the actor waits ~1.1 s of a ~2.3 s step, and
    the engines' tokens/s swing with the machine's load, whatever the limit (here: the same at every limit)."""
    running = min(4.0 * limit, 24.0)
    return StepFigures(
        limit=limit,
        mean_inflight=float(limit),
        tokens_per_s=300.0 * (1 + rng.uniform(-0.3, 0.3)),
        wait_inflight=0.95,
        wait_buffer=0.0,
        running_reqs=running,
        queue_reqs=max(0.0, 4.0 * limit - 24.0) if queue else 0.0,
        wait_data_s=1.1,
        step_s=2.3,
        arrived_groups=8.0,
        trained_groups=8,
    )


def test_noisy_throughput_while_the_actor_waits_is_not_over_admission():
    """Generation sets the pace and the engines queue nothing: throughput that reads no lower at a lower limit is no
    reason to lower it (before: 8 -> 4 -> 2, the actor waiting longer each step)."""
    tuner = InflightAutotuner(start=8, upper=8)
    rng = random.Random(0)
    for _ in range(20):
        tuner.observe(_loaded_cpu_step(tuner.limit, rng))
    assert tuner.limit == 8 and tuner.history == [], tuner.history
    assert tuner.side == GENERATION


def test_generation_bound_engines_that_queue_still_lower_it():
    tuner = InflightAutotuner(start=16, upper=16)
    rng = random.Random(0)
    for _ in range(12):
        tuner.observe(_loaded_cpu_step(tuner.limit, rng, queue=True))  # 64 requests on 24 slots: 40 queue
    assert tuner.limit < 16 and "queue" in tuner.history[0].reason


def test_the_core_writes_the_side_and_logs_it_in_the_simulated_searchr1_run(caplog):
    """Search-R1 (``configs/searchr1.toml``, 2,000 tok/s engines, 85 s a step) with auto started above the supply:
    every measured step is training-bound (metric 1), the limit only comes down, and the broker log names the side."""
    from asyncrl.simulate import EngineArgs, from_config, simulate

    cfg, wl = from_config(
        str(REPO / "configs" / "searchr1.toml"),
        [],
        engine=EngineArgs(peak_tok_s=2000.0),
        train_s=85.0,
        mean_turn_tokens=250.0,
        tool_s=0.5,
        sync_s=0.2,
        steps=10,
    )
    with caplog.at_level(logging.INFO, logger="asyncrl.broker"):
        r = simulate(replace(cfg, inflight="auto", auto_start=512), wl)
    assert [m["rollout/buffer/training_bound"] for m in r.metrics[1:]] == [1.0] * 9  # step 0 waits for the start
    assert r.metrics[0]["rollout/buffer/training_bound"] == 0.0
    assert r.limits[0] == 512 and all(b <= a for a, b in zip(r.limits, r.limits[1:])) and r.limits[-1] < 400
    assert "training sets the pace" in caplog.text
