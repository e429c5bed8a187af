"""Property tests of the broker core: random event sequences, invariants checked after every event."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.broker.buffer import BufferSettings, DefaultDataBuffer
from asyncrl.broker.core import BrokerCore, CoreSettings
from asyncrl.broker.types import PromptItem, Trajectory


def reject_negative(group):
    """Dynamic-sampling filter used by the tests: all-negative rewards are dropped as ``neg``."""
    return "neg" if all(t.reward < 0 for t in group.trajectories) else None


core_settings = st.builds(
    lambda B, G, inflight, extra_buf, gran, unused, cap, sync: CoreSettings(
        rollout_batch_size=B,
        group_size=G,
        max_inflight_groups=inflight,
        max_buffered_groups=B + extra_buf,
        max_dropped_groups_per_step=10_000,
        submission_granularity=gran,
        unused_groups=unused,
        max_staleness=cap,
        sync_mode=sync,
        seed=7,
        no_data_warning_s=5.0,
        worker_heartbeat_timeout_s=4.0,
    ),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(1, 6),
    st.integers(0, 6),
    st.sampled_from(["group", "sample"]),
    st.sampled_from(["drop", "retry"]),
    st.one_of(st.none(), st.integers(0, 2)),
    st.booleans(),
)

finish_many = st.tuples(
    st.just("finish_many"),
    st.lists(
        st.tuples(st.integers(0, 50), st.sampled_from(["ok", "ok", "aborted", "neg"]), st.integers(0, 3)),
        min_size=1,
        max_size=6,
    ),
    st.booleans(),
)

events = st.lists(
    st.one_of(
        st.tuples(st.just("advance"), st.floats(0.0, 3.0)),
        st.tuples(st.just("add_worker"), st.integers(0, 2)),
        st.tuples(st.just("remove_worker"), st.integers(0, 2)),
        st.tuples(st.just("traj"), st.integers(0, 50), st.integers(0, 2)),
        st.tuples(
            st.just("finish"),
            st.integers(0, 50),
            st.sampled_from(["ok", "ok", "ok", "aborted", "neg"]),
            st.integers(0, 3),
        ),
        finish_many,
        finish_many,  # twice: batched arrivals (a worker's ``groups`` message) as often as the rest
        st.tuples(
            st.just("request"),
        ),
        st.tuples(st.just("sync"), st.sampled_from(["retract", "drain"])),
        st.tuples(
            st.just("sync_end"),
        ),
        st.tuples(
            st.just("tick"),
        ),
    ),
    min_size=1,
    max_size=120,
)


class Model:
    """What the test knows from outside the core, to check it against."""

    def __init__(self, core: BrokerCore, n_prompts: int):
        self.core, self.n = core, n_prompts
        self.issued: dict[int, tuple[int, int, int]] = {}  # gid -> (epoch, index, issued_version)
        self.arrived: list[int] = []  # group ids put in the buffer, arrival order
        self.trained: list[tuple[int, int]] = []
        self.dropped: list[tuple[int, int]] = []
        self.all_drops = 0
        self.step_drops = 0
        self.step = 0
        self.request_version = None
        self.versions_of: dict[int, int] = {}  # gid -> min_version sent

    def absorb(self):
        for iss in self.core.take_issues():
            assert iss.group_id not in self.issued
            self.issued[iss.group_id] = (iss.epoch, iss.item.index, iss.version)
        for d in self.core.take_drops():
            self.all_drops += 1
            self.step_drops += 1
            if d.group_id in self.arrived:
                self.arrived.remove(d.group_id)
            if not d.retried:
                self.dropped.append((d.epoch, d.item.index))
        batch = self.core.take_batch()
        if batch is not None:
            self.check_batch(batch)

    def check_batch(self, batch):
        s = self.core.s
        ids = [g.group_id for g in batch.groups]
        assert len(ids) == s.rollout_batch_size
        assert ids == self.arrived[: len(ids)], "hand-off must be the oldest groups, in arrival order"
        del self.arrived[: len(ids)]
        v = self.request_version
        st_ = [v - g.min_version for g in batch.groups]
        for g in batch.groups:
            assert g.min_version == self.versions_of[g.group_id]
            assert g.finished_version - g.min_version >= 0 and v - g.finished_version >= 0
            if s.max_staleness is not None:
                assert v - g.min_version <= s.max_staleness
        m = batch.metrics
        n = len(st_)
        assert abs(m["rollout/data_staleness/mean"] - sum(st_) / n) < 1e-9
        assert m["rollout/data_staleness/max"] == max(st_)
        assert abs(m["rollout/version_span/mean"] + m["rollout/queue_steps/mean"] - sum(st_) / n) < 1e-9
        ratios = {k: v for k, v in m.items() if k.startswith("rollout/data_staleness/ratio_")}
        assert abs(sum(ratios.values()) - 1.0) < 1e-9
        for k, c in Counter(st_).items():
            assert abs(ratios[f"rollout/data_staleness/ratio_{k}"] - c / n) < 1e-9
        assert m["rollout/buffer/dropped_groups"] == self.step_drops
        fa = "rollout/fully_async/"
        filtered = (
            m[fa + "aborted_groups_filtered"]
            + m[fa + "stale_groups_filtered"]
            + m.get("rollout/dynamic_filter/drop_neg", 0.0)
        )
        assert filtered == self.step_drops
        waits = [m["rollout/buffer/" + k] for k in ("admission_wait_inflight_limit", "admission_wait_buffer_full")]
        assert min(waits) >= 0.0 and sum(waits) <= 1.0 + 1e-9  # exclusive: a blocked second counts once
        self.step_drops = 0
        self.trained += [(g.epoch, g.item.index) for g in batch.groups]
        self.request_version = None
        self.step += 1

    def check_invariants(self):
        c, s = self.core, self.core.s
        if s.submission_granularity == "group":  # RLinf: the limit counts groups
            assert c.num_inflight_groups <= s.max_inflight_groups
        # Miles under ``sample``: trajectories (group granularity keeps it too: a group holds group_size of them)
        assert c.num_inflight_samples <= s.max_inflight_groups * s.group_size
        assert c.num_inflight_groups + c.num_buffered_groups <= s.max_buffered_groups
        if s.sync_mode:
            assert c.num_inflight_groups + c.num_buffered_groups <= s.rollout_batch_size
        # admission was re-checked: nothing issuable is left un-issued
        assert not (c._issue_allowance() > 0 and c._inflight_ok() and c._buffer_ok())
        # nothing lost: every prompt read from the dataloader is trained, dropped (returns next epoch) or held
        dl = c.dataloader
        read = Counter((e, i) for e in range(dl.epoch) for i in range(self.n))
        read.update((dl.epoch, i) for i in range(self.n))
        read.subtract((dl.epoch, i) for i in dl.remaining_in_epoch())
        accounted = Counter(self.trained) + Counter(self.dropped) + Counter(c.held())
        assert +read == accounted
        assert c.counters["dropped"] == self.all_drops
        assert c.num_buffered_groups == len(self.arrived)


def finished(core, model, gid, outcome, dv):
    """The trajectories of a finished group (min version within what the engines could have used)."""
    issued_v = model.issued[gid][2]
    vmin = min(core.version, issued_v + dv)
    model.versions_of[gid] = vmin
    reward = -1.0 if outcome == "neg" else 1.0
    trajs = [
        Trajectory([1], [2], [1], [0.0], reward=reward, min_version=vmin, max_version=core.version)
        for _ in range(core.s.group_size)
    ]
    return trajs, outcome == "aborted"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=core_settings, evs=events)
def test_core_invariants_hold_after_every_event(s, evs):
    run_events(s, evs)


batch_events = st.lists(
    st.one_of(
        finish_many,
        finish_many,
        finish_many,
        st.tuples(st.just("advance"), st.floats(0.0, 3.0)),
        st.tuples(st.just("traj"), st.integers(0, 50), st.integers(0, 2)),
        st.tuples(
            st.just("request"),
        ),
        st.tuples(st.just("sync"), st.sampled_from(["retract", "drain"])),
        st.tuples(
            st.just("sync_end"),
        ),
        st.tuples(st.just("remove_worker"), st.integers(0, 2)),
    ),
    min_size=5,
    max_size=60,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=core_settings, evs=batch_events)
def test_core_invariants_hold_with_batched_arrivals(s, evs):
    """Workers present from the start; mostly several finished groups per call (``groups_finished``)."""
    run_events(s, [("add_worker", 0), ("add_worker", 1)] + evs)


def run_events(s, evs):
    now = [0.0]
    n_prompts = 5
    prompts = [PromptItem(index=i, prompt=f"q{i}") for i in range(n_prompts)]
    buf = DefaultDataBuffer(BufferSettings(max_staleness=s.max_staleness, dynamic_filter=reject_negative))
    core = BrokerCore(prompts, settings=s, clock=lambda: now[0], data_buffer=buf)
    model = Model(core, n_prompts)
    syncing = False
    for ev in evs:
        kind = ev[0]
        inflight = sorted(core.inflight_group_ids())
        if kind == "advance":
            now[0] += ev[1]
        elif kind == "add_worker":
            core.add_worker(f"w{ev[1]}", capacity=1 + ev[1])
        elif kind == "remove_worker":
            core.remove_worker(f"w{ev[1]}")
        elif kind == "traj" and inflight:
            core.trajectory_finished(inflight[ev[1] % len(inflight)], ev[2] % s.group_size)
        elif kind == "finish" and inflight:
            gid = inflight[ev[1] % len(inflight)]
            trajs, aborted = finished(core, model, gid, ev[2], ev[3])
            core.group_finished(gid, trajs, aborted=aborted)
            model.arrived.append(gid)  # removed again below if the buffer rejected it
        elif kind == "finish_many" and inflight:
            # several groups in one call (a worker's ``groups`` message), possibly with a late/unknown id
            reports, expect, seen = [], [], set()
            for i, outcome, dv in ev[1]:
                gid = inflight[i % len(inflight)]
                if gid in seen:
                    continue
                seen.add(gid)
                trajs, aborted = finished(core, model, gid, outcome, dv)
                reports.append((gid, trajs, aborted))
                expect.append(True)
            if ev[2]:
                reports.append((10**9, None, False))
                expect.append(False)
            unknown0 = core.counters["unknown_reports"]
            assert core.groups_finished(reports) == expect
            assert core.counters["unknown_reports"] - unknown0 == expect.count(False)
            model.arrived += [gid for gid, _, _ in reports if gid in seen]
        elif kind == "request" and model.request_version is None and not syncing:
            model.request_version = core.version
            core.request_batch(model.step)
        elif kind == "sync" and not syncing and model.request_version is None:  # the actor syncs between steps
            syncing = True
            core.sync_begin(ev[1])
        elif kind == "sync_end" and syncing:
            syncing = False
            core.sync_end(core.version + 1)
        elif kind == "tick":
            core.tick()
        model.absorb()
        model.check_invariants()
