"""The pure parts of supervision: the health verdict, the actor's restart bookkeeping, the retried sync, the keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.broker.core import BrokerCore, CoreSettings
from asyncrl.broker.types import PromptItem, Trajectory
from asyncrl.config import ConfigError, load_config
from asyncrl.engine.blocking import EngineStepError
from asyncrl.engine.liveness import HealthTracker
from asyncrl.sync.group import EngineEndpoint
from asyncrl.sync.recovery import EngineRecovery, SyncAbandoned, sync_weights


def test_health_tracker_dead_at_once_hung_after_the_window():
    h = HealthTracker(unhealthy_after_s=10.0)
    assert h.observe(alive=True, ok=True, t=0.0) is None
    assert h.observe(alive=True, ok=False, t=1.0) is None
    assert h.observe(alive=True, ok=False, t=10.9) is None
    verdict = h.observe(alive=True, ok=False, t=11.0)
    assert verdict is not None and verdict.startswith("hung") and "rollout.unhealthy_after_s=10" in verdict
    h.reset()
    assert h.observe(alive=True, ok=False, t=20.0) is None
    assert h.observe(alive=True, ok=True, t=25.0) is None  # one good probe clears the window
    assert h.observe(alive=True, ok=False, t=29.0) is None
    assert h.observe(alive=False, ok=False, t=29.5, exit_code=-9) == "dead: the process exited with code -9"


class _Group:
    """The two things EngineRecovery uses of a WeightSyncGroup: its engines and ``recreate``."""

    def __init__(self, n: int):
        self.engines = [EngineEndpoint(f"http://127.0.0.1:{30000 + i}") for i in range(n)]
        self.recreated = 0

    def recreate(self):
        self.recreated += 1


def _recovery(counts: list[int], published: dict, *, wait_s: float = 5.0, max_failures: int = 3):
    group = _Group(len(counts))
    rec = EngineRecovery(
        group,
        read_restarts=lambda i: counts[i],
        publish_synced=published.__setitem__,
        wait_s=wait_s,
        max_failures=max_failures,
    )
    return group, rec


def test_recovery_rejoins_and_publishes_only_restarted_engines():
    counts, published = [0, 0], {}
    group, rec = _recovery(counts, published)
    assert not rec.pending() and rec.total_restarts() == 0
    rec.before_sync()
    rec.after_sync()
    assert group.recreated == 0 and published == {}
    counts[1] = 1  # engine 1 restarted: it waits for the actor
    assert rec.pending() and rec.total_restarts() == 1
    rec.before_sync()
    assert group.recreated == 1
    assert rec.pending()  # joined, not yet synced
    rec.after_sync()
    assert published == {1: 1} and not rec.pending()
    rec.before_sync()
    assert group.recreated == 1  # nothing moved since


def test_recovery_failure_waits_for_a_restart_or_reraises():
    counts, published = [0], {}
    _, rec = _recovery(counts, published, wait_s=0.3)
    err = EngineStepError("http://127.0.0.1:30000", "pause_generation", "connection refused")
    with pytest.raises(EngineStepError):
        rec.after_failure(err)  # no restart shows up: the original error, naming the engine
    calls = []

    def read(i):
        calls.append(i)
        return 1 if len(calls) > 3 else 0  # the restart appears while the actor waits

    rec.read_restarts = read
    rec.wait_s = 30.0
    rec.after_failure(err)
    assert len(calls) > 3
    rec.failures = rec.max_failures
    with pytest.raises(EngineStepError):
        rec.after_failure(err)  # too many failed syncs: give up


class _Actor:
    version = 7

    def __init__(self):
        self.iterated = []

    def iter_hf_buckets(self, bucket_bytes):
        for i in range(3):
            self.iterated.append(i)
            yield [(f"w{i}", None)]


class _Syncer:
    """Fails its first sync after one bucket (an engine died under it), then succeeds."""

    def __init__(self, counts):
        self.counts, self.calls = counts, 0

    def sync(self, buckets, version):
        self.calls += 1
        next(buckets)
        if self.calls == 1:
            self.counts[0] = 1  # the rollout rank restarted it meanwhile
            raise RuntimeError("Connection closed by peer")
        return list(buckets), version


def test_sync_weights_retries_after_a_restart_and_finishes_every_gather():
    counts, published = [0], {}
    group, rec = _recovery(counts, published)
    actor, syncer = _Actor(), _Syncer(counts)
    decisions = []
    res = sync_weights(actor, syncer, rec, bucket_bytes=1, is_leader=True, bcast=lambda x: decisions.append(x) or x)
    assert res == ([[("w1", None)], [("w2", None)]], 7)
    assert decisions == ["retry", None]  # every rank was told to retry once, then done
    assert actor.iterated == [0, 1, 2, 0, 1, 2]  # the failed attempt still ran the whole (collective) gather
    assert group.recreated == 1 and published == {0: 1}


def test_sync_weights_without_a_restart_propagates():
    counts = [0]
    _, rec = _recovery(counts, {}, wait_s=0.2)

    class Broken:
        def sync(self, buckets, version):
            raise EngineStepError("http://127.0.0.1:30000", "pause_generation", "timed out")

    with pytest.raises(EngineStepError, match="127.0.0.1:30000"):
        sync_weights(_Actor(), Broken(), rec, bucket_bytes=1, is_leader=True, bcast=lambda x: x)


class _Broken:
    def sync(self, buckets, version):
        next(buckets)
        raise RuntimeError("Connection closed by peer")  # the engines stopped under a preemption


@pytest.mark.parametrize("when", ["before", "while waiting"])
def test_sync_weights_abandoned_once_the_run_is_stopping(when):
    """A preemption signal arrived (``abandon``): a failed sync is neither retried nor waited for (``wait_s`` is
    long here); every rank is told to give up, after the whole gather."""
    _, rec = _recovery([0], {}, wait_s=60.0)
    polls = []
    rec.abandon = (lambda: True) if when == "before" else (lambda: polls.append(1) or len(polls) > 3)
    actor, decisions = _Actor(), []
    with pytest.raises(SyncAbandoned, match="version 7 abandoned.*Connection closed"):
        sync_weights(actor, _Broken(), rec, bucket_bytes=1, is_leader=True, bcast=lambda x: decisions.append(x) or x)
    assert decisions == ["abandon"] and actor.iterated == [0, 1, 2]


def test_sync_weights_abandon_reaches_the_other_ranks():
    actor = _Actor()
    with pytest.raises(SyncAbandoned):
        sync_weights(actor, None, None, bucket_bytes=1, is_leader=False, bcast=lambda x: "abandon")
    assert actor.iterated == [0, 1, 2]


@pytest.mark.parametrize(
    "override, key",
    [
        ("rollout.health_check_interval_s=0", "rollout.health_check_interval_s"),
        ("rollout.health_check_timeout_s=-1", "rollout.health_check_timeout_s"),
        ("rollout.unhealthy_after_s=0", "rollout.unhealthy_after_s"),
        ("rollout.health_check_timeout_s=20", "rollout.health_check_timeout_s"),  # not below unhealthy_after_s
    ],
)
def test_supervision_keys_are_checked(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(Path(__file__).resolve().parents[2] / "configs/tiny.toml", [override])


def _traj():
    return Trajectory(list(range(4)), [1, 2, 3], [1] * 3, [-0.5] * 3, reward=1.0, min_version=0, max_version=0)


def test_a_batch_asked_for_in_slices_keeps_its_wait_time_and_the_warning_clock():
    """The leader asks for a batch in short slices (so it can serve a restarted engine meanwhile): a re-request
    of the same step continues the first one (``time/wait_data``, the no-data warning), a new step starts anew;
    an engine's worker leaving re-issues its groups, counted as re-issued, and the accounting holds."""
    t = [0.0]
    core = BrokerCore(
        [PromptItem(i, f"q{i}") for i in range(10)],
        clock=lambda: t[0],
        settings=CoreSettings(
            rollout_batch_size=2,
            group_size=3,
            max_inflight_groups=3,
            max_buffered_groups=4,
            max_dropped_groups_per_step=100,
            no_data_warning_s=5.0,
        ),
    )
    core.add_worker("engine0", capacity=9)
    first = [i.group_id for i in core.take_issues()]
    core.request_batch(step=1)
    for _ in range(3):  # three 2-second slices, each withdrawn by the server's timeout
        t[0] += 2.0
        assert core.tick() == [] or t[0] >= 5.0
        core.cancel_request()
        core.request_batch(step=1)
    assert core.counters["no_data_warnings"] == 1  # 6 s of waiting for step 1 did warn once
    assert core.remove_worker("engine0") == sorted(first)  # the engine died: its groups go back
    core.add_worker("engine0", capacity=9)  # restarted and synced: hello again
    again = [i.group_id for i in core.take_issues()]
    assert len(again) == len(first) and not set(again) & set(first)
    for gid in again[:2]:
        assert core.group_finished(gid, [_traj() for _ in range(3)])
    batch = core.take_batch()
    assert batch is not None and batch.wait_s == pytest.approx(6.0)
    c = core.counters
    held = core.num_inflight_groups + core.num_buffered_groups
    assert c["issued"] == c["trained"] + c["dropped"] + held + c["reissued"] and c["dropped"] == 0
    assert c["reissued"] == len(first)
    core.request_batch(step=2)  # a new step: a new wait
    t[0] += 1.0
    core.cancel_request()
    core.request_batch(step=2)
    assert core._request.t == pytest.approx(6.0)
