"""The broker core's maintained indexes (least-loaded heap, last-seen order, per-worker counters, the
buffer's min version) against a brute-force recomputation after every event of a random sequence; and
the start-up admission (the first worker to join must not take the whole first burst)."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.broker.buffer import BufferSettings, DefaultDataBuffer
from asyncrl.broker.core import BrokerCore, CoreSettings
from asyncrl.broker.types import PromptItem, Trajectory
from asyncrl.config import load_config
from asyncrl.config.derive import num_engines

core_settings = st.builds(
    lambda B, G, inflight, extra_buf, gran, cap, expected, grace: CoreSettings(
        rollout_batch_size=B,
        group_size=G,
        max_inflight_groups=inflight,
        max_buffered_groups=B + extra_buf,
        max_dropped_groups_per_step=10_000,
        submission_granularity=gran,
        max_staleness=cap,
        seed=3,
        no_data_warning_s=5.0,
        worker_heartbeat_timeout_s=4.0,
        expected_workers=expected,
        worker_join_grace_s=grace,
    ),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(1, 12),
    st.integers(0, 8),
    st.sampled_from(["group", "sample"]),
    st.one_of(st.none(), st.integers(0, 2)),
    st.integers(0, 6),
    st.sampled_from([0.0, 2.0, 100.0]),
)

events = st.lists(
    st.one_of(
        st.tuples(st.just("advance"), st.floats(0.0, 3.0)),
        st.tuples(st.just("add_worker"), st.integers(0, 5), st.integers(1, 9)),
        st.tuples(st.just("remove_worker"), st.integers(0, 5)),
        st.tuples(st.just("heartbeat"), st.integers(0, 5)),
        st.tuples(st.just("traj"), st.integers(0, 50), st.integers(0, 2)),
        st.tuples(st.just("finish"), st.integers(0, 50), st.booleans(), st.integers(0, 2)),
        st.tuples(
            st.just("request"),
        ),
        st.tuples(
            st.just("sync"),
        ),
        st.tuples(
            st.just("tick"),
        ),
    ),
    min_size=1,
    max_size=150,
)


def check_indexes(core: BrokerCore, peak_capacity: dict[str, int]) -> None:
    """Every maintained index equals its brute-force recomputation."""
    workers, inflight = core._pool.workers, core._inflight.groups
    for wid, w in workers.items():
        mine = {gid for gid, g in inflight.items() if g.worker_id == wid}
        assert w.groups == mine
        assert w.outstanding == sum(inflight[gid].outstanding for gid in mine)
    assert all(g.worker_id in workers for g in inflight.values())
    assert core._inflight.samples == sum(g.outstanding for g in inflight.values())
    assert core.num_inflight_samples == sum(core.s.group_size - len(g.trajectories) for g in inflight.values())
    if workers:
        wid, _ = core._pool.least_loaded()
        assert wid == min(workers, key=lambda k: (workers[k].outstanding / workers[k].capacity, k))
    assert len(core._pool.load_heap) <= 2 * len(workers) + 64 + len(workers)  # compacted (+ the last flush)
    # last-seen order: the same workers, last_seen non-decreasing from the front
    order = list(core._pool.by_seen)
    assert sorted(order) == sorted(workers)
    seen = [workers[w].last_seen for w in order]
    assert seen == sorted(seen)
    buf = core.buffer
    mv = buf._min_version
    assert set(mv) == {g.group_id for g in buf.groups()}
    assert buf._version_sum == sum(mv.values())
    if mv:
        assert buf._oldest_version() == min(mv.values())
    # start-up: while joining, a worker is issued nothing once at capacity (so at most capacity + G - 1, with the
    # highest capacity it announced: a hello again may lower it below what it already holds)
    if core._pool.joining:
        for wid, w in workers.items():
            assert w.outstanding <= peak_capacity[wid] + core.s.group_size - 1
    # admission was re-checked: nothing issuable left, unless every worker is full during start-up
    room = core._issue_allowance() > 0 and core._inflight_ok() and core._buffer_ok()
    if room:
        assert core._pool.joining and all(w.outstanding >= w.capacity for w in workers.values())


def trajs(core, vmin):
    return [
        Trajectory([1], [2], [1], [0.0], reward=1.0, min_version=vmin, max_version=core.version)
        for _ in range(core.s.group_size)
    ]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=core_settings, evs=events)
def test_indexes_match_brute_force_after_every_event(s, evs):
    now = [0.0]
    buf = DefaultDataBuffer(BufferSettings(max_staleness=s.max_staleness))
    core = BrokerCore([PromptItem(i, f"q{i}") for i in range(7)], settings=s, clock=lambda: now[0], data_buffer=buf)
    step, requested = 0, False
    peak: dict[str, int] = {}
    for ev in evs:
        kind = ev[0]
        ids = sorted(core.inflight_group_ids())
        if kind == "advance":
            now[0] += ev[1]
        elif kind == "add_worker":
            core.add_worker(f"w{ev[1]}", capacity=ev[2])
            peak[f"w{ev[1]}"] = max(peak.get(f"w{ev[1]}", 0), ev[2])
        elif kind == "remove_worker":
            core.remove_worker(f"w{ev[1]}")
            peak.pop(f"w{ev[1]}", None)
        elif kind == "heartbeat":
            core.heartbeat(f"w{ev[1]}")
        elif kind == "traj" and ids:
            gid = ids[ev[1] % len(ids)]
            assert core.is_inflight(gid)
            core.trajectory_finished(gid, ev[2] % s.group_size)
        elif kind == "finish" and ids:
            gid = ids[ev[1] % len(ids)]
            core.group_finished(gid, trajs(core, max(0, core.version - ev[3])), aborted=ev[2])
            assert not core.is_inflight(gid)
        elif kind == "request" and not requested:
            core.request_batch(step)
            requested = True
        elif kind == "sync" and not requested:
            core.sync_begin("retract")
            core.sync_end(core.version + 1)
        elif kind == "tick":
            expired = {w for w, x in core._pool.workers.items() if now[0] - x.last_seen > s.worker_heartbeat_timeout_s}
            before = set(core._pool.workers)
            core.tick()
            assert set(core._pool.workers) == before - expired
            for w in expired:
                peak.pop(w)
        core.take_issues()
        core.take_drops()
        if core.take_batch() is not None:
            step, requested = step + 1, False
        check_indexes(core, peak)


# ----------------------------------------------------------------------------- start-up admission
def make(expected, *, inflight=40, gs=4, grace=60.0):
    now = [0.0]
    s = CoreSettings(
        rollout_batch_size=8,
        group_size=gs,
        max_inflight_groups=inflight,
        max_buffered_groups=inflight + 8,
        max_dropped_groups_per_step=100,
        seed=1,
        expected_workers=expected,
        worker_join_grace_s=grace,
    )
    return BrokerCore([PromptItem(i, f"q{i}") for i in range(100)], settings=s, clock=lambda: now[0]), now


def per_worker(issues):
    out: dict[str, int] = {}
    for i in issues:
        out[i.worker_id] = out.get(i.worker_id, 0) + 1
    return out


def test_first_worker_does_not_take_the_whole_first_burst():
    core, now = make(expected=4)
    core.add_worker("w0", capacity=8)
    assert per_worker(core.take_issues()) == {"w0": 2}  # its capacity (8 trajectories), not all 40 groups
    issues = []
    for k in (1, 2, 3):
        now[0] += 1.0
        core.add_worker(f"w{k}", capacity=8)
        issues += core.take_issues()
    counts = per_worker(issues)
    counts["w0"] += 2
    assert sum(counts.values()) == 40 and max(counts.values()) - min(counts.values()) <= 1  # the last join fills
    assert not core._pool.joining


def test_expected_workers_zero_keeps_the_old_behaviour():
    core, _ = make(expected=0)
    core.add_worker("w0", capacity=8)
    assert per_worker(core.take_issues()) == {"w0": 40}


def test_grace_loads_the_workers_that_came_when_others_never_do():
    core, now = make(expected=4, grace=10.0)
    core.add_worker("w0", capacity=8)
    core.add_worker("w1", capacity=8)
    assert per_worker(core.take_issues()) == {"w0": 2, "w1": 2}
    now[0] += 5.0
    core.tick()
    assert core.take_issues() == []
    now[0] += 6.0
    core.tick()  # the grace ran out with no other event: the rest is issued
    assert per_worker(core.take_issues()) == {"w0": 18, "w1": 18}


def test_a_finished_trajectory_frees_room_during_start_up():
    core, now = make(expected=2, gs=2)
    core.add_worker("w0", capacity=3)
    (a, b) = core.take_issues()  # 2 groups x 2 = 4 trajectories: past capacity 3 after the second
    now[0] += 1.0
    core.group_finished(a.group_id, [Trajectory([1], [2], [1], [0.0]) for _ in range(2)])
    assert per_worker(core.take_issues()) == {"w0": 1}


def test_sixty_four_workers_joining_one_by_one_share_the_burst():
    """The simulator's case (64 engines, one worker each, joining in turn): no worker holds the burst."""
    core, now = make(expected=64, inflight=800, gs=8)
    issues = []
    for k in range(64):
        now[0] += 0.01
        core.add_worker(f"w{k}", capacity=12)
        issues += core.take_issues()
    counts = per_worker(issues)
    assert sum(counts.values()) == 800 and max(counts.values()) <= math.ceil(800 / 64) + 1


def test_from_config_expects_one_worker_per_engine():
    cfg = load_config("configs/tiny.toml", [])
    assert CoreSettings.from_config(cfg).expected_workers == num_engines(cfg)
