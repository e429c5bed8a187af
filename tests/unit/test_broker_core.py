"""Targeted behaviours of the broker core, dataloader, buffer plug-ins and wire protocol."""

from __future__ import annotations

import logging

import pytest

from asyncrl.broker import protocol as P
from asyncrl.broker.buffer import BufferSettings, DataBuffer, DefaultDataBuffer
from asyncrl.broker.buffer_plugin import make_data_buffer
from asyncrl.broker.core import BrokerCore, CoreSettings, TooManyDropsError
from asyncrl.broker.dataloader import Dataloader
from asyncrl.broker.types import PromptItem, Trajectory
from asyncrl.config import load_config


def reject_short(group):
    return "short" if all(len(t.response_ids) < 2 for t in group.trajectories) else None


class LifoBuffer(DefaultDataBuffer):
    """A custom DataBuffer (by import path) that hands over the newest groups."""

    def get(self, num_groups, *, engine_version):
        if len(self._q) < num_groups:
            return None, []
        return [self._q.pop() for _ in range(num_groups)], []


def make(n=10, clock=None, **kw):
    t = clock if clock is not None else [0.0]
    base = dict(
        rollout_batch_size=2,
        group_size=2,
        max_inflight_groups=3,
        max_buffered_groups=4,
        max_dropped_groups_per_step=100,
        seed=3,
    )
    base.update(kw)
    core = BrokerCore([PromptItem(i, f"q{i}") for i in range(n)], settings=CoreSettings(**base), clock=lambda: t[0])
    return core, t


def traj(vmin=0, vmax=None, n=3, reward=1.0):
    return Trajectory(
        list(range(4)),
        list(range(n)),
        [1] * n,
        [-0.5] * n,
        reward=reward,
        min_version=vmin,
        max_version=vmin if vmax is None else vmax,
    )


def finish(core, gid, vmin=0, aborted=False, **kw):
    return core.group_finished(gid, [traj(vmin, **kw) for _ in range(core.s.group_size)], aborted=aborted)


def test_dataloader_epochs_seeded_and_resumable():
    items = [PromptItem(i, f"q{i}") for i in range(7)]
    a, b = Dataloader(items, seed=1), Dataloader(items, seed=1)
    seq_a = [a.next() for _ in range(10)]
    assert seq_a == [b.next() for _ in range(10)]
    assert sorted(it.index for it, e in seq_a[:7]) == list(range(7)) and {e for _, e in seq_a[:7]} == {0}
    assert [e for _, e in seq_a[7:]] == [1, 1, 1]
    assert [it.index for it, _ in seq_a[:7]] != list(range(7))  # shuffled
    c = Dataloader(items, seed=1)
    c.load_state_dict(a.state_dict())
    assert [c.next() for _ in range(9)] == [a.next() for _ in range(9)]
    assert [Dataloader(items, seed=1, shuffle=False).next()[0].index for _ in range(1)] == [0]
    with pytest.raises(ValueError, match="data.train_path"):
        Dataloader(items[:3], seed=1).load_state_dict(a.state_dict())


def test_group_granularity_and_buffer_limit():
    core, t = make()
    core.add_worker("w", capacity=8)
    issues = core.take_issues()
    assert len(issues) == 3  # in-flight limit
    for iss in issues:
        finish(core, iss.group_id)
    # 3 buffered + 1 in flight = max_buffered_groups 4: the buffer limit binds
    assert core.num_buffered_groups == 3 and core.num_inflight_groups == 1
    t[0] = 10.0
    core.request_batch(0)
    batch = core.take_batch()
    assert [g.group_id for g in batch.groups] == [issues[0].group_id, issues[1].group_id]
    m = batch.metrics
    assert m["rollout/buffer/admission_wait_buffer_full"] == pytest.approx(1.0)
    assert m["rollout/buffer/admission_wait_inflight_limit"] == pytest.approx(0.0)
    assert core.num_inflight_groups == 3  # hand-off freed capacity, re-checked at once


def test_the_inflight_limit_counts_groups_under_group_granularity():
    """RLinf's max_inflight_groups = 2 is a budget of 2 groups: finished trajectories of unfinished groups never let
    a third group out (``sample``, Miles' counting, is tested in test_sample_granularity.py)."""
    core, _ = make(
        submission_granularity="group",
        max_inflight_groups=2,
        max_buffered_groups=10,
        rollout_batch_size=2,
        group_size=3,
    )
    core.add_worker("w", capacity=12)
    first = core.take_issues()
    assert len(first) == 2
    for g in first:
        for i in range(2):  # all but one trajectory of each group
            core.trajectory_finished(g.group_id, i)
    assert core.take_issues() == [] and core.num_inflight_groups == 2
    core.group_finished(first[0].group_id, [traj() for _ in range(3)])
    assert len(core.take_issues()) == 1 and core.num_inflight_groups == 2


def test_staleness_split_and_cap_drops_with_replacement_issue():
    core, _ = make(max_staleness=1, max_buffered_groups=6, max_inflight_groups=6, rollout_batch_size=2)
    core.add_worker("w", capacity=8)
    issues = core.take_issues()
    finish(core, issues[0].group_id, vmin=0)
    core.sync_end(1)
    core.sync_end(2)
    finish(core, issues[1].group_id, vmin=1, vmax=2)
    finish(core, issues[2].group_id, vmin=2)
    before = core.counters["issued"]
    core.request_batch(5, actor_version=2)
    batch = core.take_batch()
    drops = core.take_drops()
    assert [d.reason for d in drops] == ["stale"] and drops[0].group_id == issues[0].group_id
    assert not drops[0].retried  # unused_groups = drop: the prompt returns next epoch
    # one replacement for the dropped group + two for the handed-over batch: both free capacity
    assert core.counters["issued"] == before + 3
    assert core.num_inflight_groups + core.num_buffered_groups == 6
    assert [g.group_id for g in batch.groups] == [issues[1].group_id, issues[2].group_id]
    m = batch.metrics
    assert m["rollout/data_staleness/mean"] == 0.5 and m["rollout/data_staleness/max"] == 1
    assert m["rollout/data_staleness/ratio_0"] == 0.5 and m["rollout/data_staleness/ratio_1"] == 0.5
    assert m["rollout/version_span/mean"] == 0.5 and m["rollout/queue_steps/mean"] == 0.0
    assert m["rollout/fully_async/stale_groups_filtered"] == 1


def test_aborted_retry_requeues_at_once_and_filter_drops_by_reason():
    core, _ = make(
        unused_groups="retry", max_inflight_groups=1, dynamic_sampling_filter_path=f"{__name__}:reject_short"
    )
    core.add_worker("w", capacity=8)
    (a,) = core.take_issues()
    finish(core, a.group_id, aborted=True)
    (b,) = core.take_issues()
    assert (b.item.index, b.epoch) == (a.item.index, a.epoch) and b.group_id != a.group_id
    finish(core, b.group_id, n=1)  # rejected by the dynamic filter: always dropped, never retried
    (c,) = core.take_issues()
    assert c.item.index != a.item.index
    drops = core.take_drops()
    assert [(d.reason, d.retried) for d in drops] == [("aborted", True), ("short", False)]
    finish(core, c.group_id)
    (d,) = core.take_issues()
    finish(core, d.group_id)
    core.request_batch(0)
    m = core.take_batch().metrics
    assert m["rollout/dynamic_filter/drop_short"] == 1 and m["rollout/fully_async/aborted_groups_filtered"] == 1
    assert m["rollout/buffer/dropped_groups"] == 2 and m["rollout/buffer/retried_groups"] == 1


def test_too_many_drops_stops_with_an_error_naming_the_setting():
    core, _ = make(max_dropped_groups_per_step=2, max_inflight_groups=1, rollout_batch_size=1)
    core.add_worker("w", capacity=8)
    for _ in range(3):
        (iss,) = core.take_issues()
        finish(core, iss.group_id, aborted=True)
    assert core.take_issues() == []  # issuing stopped
    with pytest.raises(TooManyDropsError, match="rollout_buffer.max_dropped_groups_per_step") as e:
        core.request_batch(0)
    assert "aborted" in str(e.value) and "raise" in str(e.value)


def test_dead_worker_groups_are_reissued_to_the_others():
    core, t = make(worker_heartbeat_timeout_s=5.0, max_inflight_groups=4, max_buffered_groups=8)
    core.add_worker("a", capacity=4)
    lost = core.take_issues()
    assert len(lost) == 4 and {i.worker_id for i in lost} == {"a"}
    core.add_worker("b", capacity=4)
    t[0] = 3.0
    core.heartbeat("b")
    t[0] = 6.0
    core.tick()  # "a" silent for 6 s > 5 s
    again = core.take_issues()
    assert sorted(i.item.index for i in again) == sorted(i.item.index for i in lost)
    assert all(i.worker_id == "b" for i in again)
    assert core.group_finished(lost[0].group_id, [traj()] * 2) is False  # late report ignored
    assert core.counters["reissued"] == len(lost) and core.counters["unknown_reports"] == 1


def test_sync_mode_issues_exactly_one_batch_and_drain_pauses():
    core, _ = make(sync_mode=True, max_inflight_groups=10, max_buffered_groups=10, rollout_batch_size=3)
    core.add_worker("w", capacity=8)
    assert core.take_issues() == []  # nothing until the actor asks
    core.request_batch(0)
    issues = core.take_issues()
    assert len(issues) == 3
    finish(core, issues[0].group_id, aborted=True)  # dropped: one replacement
    assert len(core.take_issues()) == 1
    core.sync_begin("drain")
    assert core.hold_new_turns
    core.sync_end(1)
    assert not core.hold_new_turns

    async_core, _ = make(max_inflight_groups=10, max_buffered_groups=20)
    async_core.add_worker("w", capacity=8)
    async_core.take_issues()
    async_core.sync_begin("drain")
    (g,) = [async_core.inflight_group_ids()[0]]
    finish(async_core, g)
    assert async_core.take_issues() == []  # paused
    async_core.sync_end(1)
    assert len(async_core.take_issues()) == 1


def test_no_data_warning(caplog):
    core, t = make(no_data_warning_s=30.0)
    core.add_worker("w", capacity=8)
    core.request_batch(0)
    t[0] = 29.0
    assert core.tick() == []
    t[0] = 30.5
    with caplog.at_level(logging.WARNING, logger="asyncrl.broker"):
        (msg,) = core.tick()
    assert msg.startswith("No completed rollout groups for 30.0s")
    assert core.tick() == []  # not again before another interval


def test_state_dict_roundtrip_reissues_inflight_first():
    core, _ = make(max_inflight_groups=2, max_buffered_groups=5)
    core.add_worker("w", capacity=8)
    a, b = core.take_issues()
    finish(core, a.group_id)
    (c,) = core.take_issues()
    body, blobs = P.pack_state(core.state_dict())
    state = P.unpack_state(*P.state_from_bytes(P.state_to_bytes(body, blobs)))
    fresh, _ = make(max_inflight_groups=2, max_buffered_groups=5)
    fresh.load_state_dict(state)
    fresh.add_worker("w2", capacity=8)
    re = fresh.take_issues()
    assert [i.item.index for i in re] == [b.item.index, c.item.index]
    assert fresh.num_buffered_groups == 1 and fresh.buffer.groups()[0].group_id == a.group_id
    assert all(i.group_id > a.group_id for i in re)
    assert fresh.dataloader.state_dict() == core.dataloader.state_dict()


def _accounting_holds(core) -> bool:
    c = core.counters
    held = core.num_inflight_groups + core.num_buffered_groups
    return c["issued"] == c["trained"] + c["dropped"] + held + c["reissued"]


def _mid_run_state(core):
    core.add_worker("w", capacity=8)
    issues = core.take_issues()
    for iss in issues[:2]:
        finish(core, iss.group_id)
    core.request_batch(0)
    assert core.take_batch() is not None  # two groups trained
    for iss in core.take_issues()[:1]:
        finish(core, iss.group_id)
    assert core.counters["trained"] == 2 and core.num_buffered_groups >= 1 and core.num_inflight_groups >= 1
    body, blobs = P.pack_state(core.state_dict())
    return P.unpack_state(*P.state_from_bytes(P.state_to_bytes(body, blobs)))


def test_resume_restores_the_counters_and_the_accounting_holds():
    """Resume keeps the lifetime counters (they restarted at 0 before, breaking the accounting invariant); the
    checkpoint's in-flight groups are issued again and count as re-issued."""
    core, _ = make(max_inflight_groups=3, max_buffered_groups=6)
    state = _mid_run_state(core)
    fresh, _ = make(max_inflight_groups=3, max_buffered_groups=6)
    fresh.load_state_dict(state)
    assert fresh.counters["trained"] == 2 and fresh.counters["issued"] == core.counters["issued"]
    assert fresh.counters["reissued"] == core.num_inflight_groups
    assert _accounting_holds(fresh)
    fresh.add_worker("w2", capacity=8)
    fresh.take_issues()
    assert _accounting_holds(fresh) and fresh.counters["issued"] > core.counters["issued"]


@pytest.mark.parametrize(
    "field,bad,match",
    [
        ("counters", {"issued": 1}, "issued == trained"),
        ("counters", {"issued": -1}, "counters.issued"),
        ("version", -3, "version"),
        ("next_group_id", 0, "next_group_id"),
    ],
)
def test_a_bad_broker_state_is_refused_and_changes_nothing(field, bad, match):
    """A state that would break the accounting (or is out of range) raises naming the field before anything is
    restored (today it was loaded unchecked)."""
    core, _ = make(max_inflight_groups=3, max_buffered_groups=6)
    state = dict(_mid_run_state(core), **{field: bad})
    target, _ = make(max_inflight_groups=3, max_buffered_groups=6)
    target.add_worker("w", capacity=8)
    before = (dict(target.counters), target.inflight_group_ids(), target.dataloader.state_dict(), target.version)
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(state)
    assert before == (
        dict(target.counters),
        target.inflight_group_ids(),
        target.dataloader.state_dict(),
        target.version,
    )


def test_custom_buffer_by_import_path():
    buf = make_data_buffer(BufferSettings(), f"{__name__}:LifoBuffer")
    assert isinstance(buf, DataBuffer) and type(buf).__name__ == "LifoBuffer"
    core, _ = make(custom_data_buffer_path=f"{__name__}:LifoBuffer", max_inflight_groups=2)
    core.add_worker("w", capacity=8)
    a, b = core.take_issues()
    finish(core, a.group_id)
    finish(core, b.group_id)
    core.request_batch(0)
    assert [g.group_id for g in core.take_batch().groups] == [b.group_id, a.group_id]
    with pytest.raises(ValueError, match="rollout_buffer.custom_data_buffer_path"):
        make(custom_data_buffer_path="asyncrl.broker.buffer:Nope")


def test_settings_from_config():
    cfg = load_config(None, ["data.rollout_batch_size=4", "runner.async_mode=true"])
    s = CoreSettings.from_config(cfg)
    assert s.max_buffered_groups == 8 and s.max_dropped_groups_per_step == 40
    assert s.submission_granularity == "group" and not s.sync_mode  # RLinf's counting unless a Miles user asks


def test_settings_take_the_derived_values_from_the_resolved_config():
    # config/derive.py computes each derived default; the broker copies the resolved value (an explicit one too)
    cfg = load_config(None, ["runner.async_mode=true", "rollout_buffer.submission_granularity=group"])
    assert CoreSettings.from_config(cfg).submission_granularity == "group"
    with pytest.raises(ValueError, match="resolve the config first"):
        CoreSettings.from_config(load_config(None, ["runner.async_mode=true"], resolve=False))


def test_groups_finished_batch_matches_one_by_one():
    def run(batched):
        core, _ = make(rollout_batch_size=2, max_inflight_groups=4, max_buffered_groups=6)
        core.add_worker("w", capacity=8)
        gids = [i.group_id for i in core.take_issues()]
        reports = [(g, [traj(0) for _ in range(core.s.group_size)], g == gids[1]) for g in gids[:3]]
        reports.append((999, None, False))
        if batched:
            known = core.groups_finished(reports)
        else:
            known = [core.group_finished(g, t, aborted=a) for g, t, a in reports]
        core.request_batch(0)
        b = core.take_batch()
        return known, [g.group_id for g in b.groups], dict(core.counters), core.num_inflight_groups

    assert run(True) == run(False)
    assert run(True)[0] == [True, True, True, False]


# ---- seed parity (issue 17): Miles' staleness, the stalest trajectory, Miles' DataBuffer interface ----------


def finish_mixed(core, gid, vmins):
    """A group whose trajectories were generated under different versions (one per trajectory)."""
    return core.group_finished(gid, [traj(v, vmax=max(vmins)) for v in vmins])


def test_miles_staleness_is_against_the_engines_version_rlinf_against_the_actors():
    """rollout.update_weights_interval = 2: the actor is at version 3 while the engines still serve version 2.
    Miles' filter and rollout/fully_async/* measure against the engines (2), RLinf's rollout/data_staleness/*
    against the actor (3); each group's staleness is its stalest trajectory's."""
    core, _ = make(max_staleness=1, max_buffered_groups=6, max_inflight_groups=3, rollout_batch_size=2)
    core.add_worker("w", capacity=8)
    a, b, c = core.take_issues()
    core.sync_end(2)
    finish_mixed(core, a.group_id, [2, 1])  # stalest trajectory at 1: engine staleness 1 (kept), actor's 2
    finish_mixed(core, b.group_id, [2, 2])
    finish_mixed(core, c.group_id, [2, 0])  # stalest trajectory at 0: staleness 2 > 1, dropped
    core.request_batch(7, actor_version=3)
    batch = core.take_batch()
    assert [d.group_id for d in core.take_drops()] == [c.group_id]
    assert [g.group_id for g in batch.groups] == [a.group_id, b.group_id]
    m = batch.metrics
    assert m["rollout/fully_async/avg_staleness"] == 0.5 and m["rollout/fully_async/max_staleness"] == 1.0
    assert m["rollout/fully_async/stale_groups_filtered"] == 1.0
    assert m["rollout/data_staleness/mean"] == 1.5 and m["rollout/data_staleness/max"] == 2.0


def test_max_prompt_tokens_skips_long_prompts_with_a_counted_warning_and_a_metric(tmp_path, caplog):
    """data.max_prompt_tokens: counted as the agent loop sends the prompt (task template, rollout tokenizer)."""
    from asyncrl.models.tiny import make_tiny_checkpoint
    from asyncrl.runner.broker_process import skip_long_prompts

    model = make_tiny_checkpoint(
        tmp_path / "model", arch="qwen2", seed=0, num_hidden_layers=1, hidden_size=32, intermediate_size=64
    )
    prompts = [PromptItem(0, "who wrote it?"), PromptItem(1, "who " * 400 + "wrote it?"), PromptItem(2, "where?")]
    base = ['agentloop.task_name="searchr1"', f'actor.model_path="{model}"']
    cfg = load_config(None, base + ["data.max_prompt_tokens=300"])
    with caplog.at_level(logging.WARNING, logger="asyncrl.broker"):
        kept, skipped = skip_long_prompts(cfg, prompts)
    assert [p.index for p in kept] == [0, 2] and [i for i, _ in skipped] == [1] and skipped[0][1] > 300
    assert "data.max_prompt_tokens = 300: skipped 1 of 3 prompts" in caplog.text
    core = BrokerCore(
        kept,
        settings=CoreSettings.from_config(load_config(None, ["data.rollout_batch_size=1", "algorithm.group_size=1"])),
        clock=lambda: 0.0,
    )
    core.num_skipped_long_prompts = len(skipped)
    core.add_worker("w", capacity=4)
    core.request_batch(0)  # sync mode: issued on request
    issue = core.take_issues()[0]
    core.group_finished(issue.group_id, [traj()])
    assert core.take_batch().metrics["data/skipped_long_prompts"] == 1.0
    with pytest.raises(ValueError, match="data.max_prompt_tokens"):
        skip_long_prompts(load_config(None, base + ["data.max_prompt_tokens=5"]), prompts)
