"""Miles' ``sample`` granularity in the broker core: each finished trajectory frees its own slot, bounded by
``max_concurrent_samples``; RLinf's group counting stays the default (issue 42, item 3)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from asyncrl.broker.core import BrokerCore, CoreSettings
from asyncrl.broker.types import PromptItem, Trajectory
from asyncrl.config import load_config


def traj():
    return Trajectory([0, 1], [2, 3], [1, 1], [-0.5, -0.5], reward=1.0)


def make(**kw) -> BrokerCore:
    base = dict(rollout_batch_size=2, group_size=3, max_inflight_groups=2, max_buffered_groups=10)
    base |= dict(max_dropped_groups_per_step=100, seed=1)
    base |= kw
    return BrokerCore([PromptItem(i, f"q{i}") for i in range(50)], settings=CoreSettings(**base), clock=lambda: 0.0)


def test_sample_granularity_lets_a_group_out_once_group_size_trajectories_finished_whichever_groups():
    """Miles: max_concurrent_samples = 6 with group_size 3 is 6 trajectory slots. Two groups fill them; three
    trajectories finishing (two of one group, one of the other) free three slots, so a third group goes out while
    both first groups are still in flight. Under the group limit (max_inflight_groups = 6 // 3 = 2) it did not."""
    core = make(submission_granularity="sample", max_inflight_samples=6)
    core.add_worker("w", capacity=32)
    a, b = core.take_issues()
    core.trajectory_finished(a.group_id, 0)
    core.trajectory_finished(a.group_id, 1)
    assert core.take_issues() == []  # two slots free < group_size
    core.trajectory_finished(b.group_id, 2)
    third = core.take_issues()
    assert len(third) == 1 and core.num_inflight_groups == 3  # more groups than max_inflight_groups
    assert core.num_inflight_samples == 6  # the trajectory budget holds
    core.trajectory_finished(a.group_id, 2)
    assert core.take_issues() == []  # one free slot
    core.group_finished(a.group_id, [traj() for _ in range(3)])  # its slots were freed already: frees nothing more
    assert core.take_issues() == [] and core.num_inflight_samples == 5


def test_group_granularity_holds_the_slot_until_the_whole_group_returns():
    """RLinf's default, the same events: finished trajectories free nothing until the group returns."""
    core = make(submission_granularity="group")
    core.add_worker("w", capacity=32)
    a, b = core.take_issues()
    for i in range(3):
        core.trajectory_finished(a.group_id, i)
    assert core.take_issues() == [] and core.num_inflight_groups == 2
    core.group_finished(a.group_id, [traj() for _ in range(3)])
    assert len(core.take_issues()) == 1 and core.num_inflight_groups == 2


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("auto", [False, True])
def test_sample_granularity_stays_within_the_trajectory_budget_and_the_buffer_limit(seed, auto):
    """Random finishing order over a run: trajectories in flight never exceed max_concurrent_samples (under "auto":
    the in-flight limit x group_size, as the autotuner moves it), in-flight plus buffered groups never exceed max_buffered_groups, and the engines are
    kept full: whenever group_size slots are free (and the buffer has room) a group is out."""
    rng = random.Random(seed)
    budget, gs, cap = 7, 3, 9
    core = make(
        submission_granularity="sample",
        max_inflight_samples=budget,
        group_size=gs,
        max_buffered_groups=cap,
        inflight_autotune=auto,
        max_inflight_groups=2,
    )
    core.add_worker("w", capacity=64)
    open_ = {}  # group_id -> trajectory indices not yet finished
    most_groups = 0
    for step in range(300):
        for iss in core.take_issues():
            open_[iss.group_id] = list(range(gs))
        limit = core.inflight_limit * gs if auto else budget
        assert core.num_inflight_samples <= limit
        assert core.num_inflight_groups + core.num_buffered_groups <= cap
        room = (limit - core.num_inflight_samples) // gs
        assert room <= 0 or core.num_inflight_groups + core.num_buffered_groups == cap
        most_groups = max(most_groups, core.num_inflight_groups)
        if open_:
            gid = rng.choice(sorted(open_))
            if open_[gid]:
                core.trajectory_finished(gid, open_[gid].pop(rng.randrange(len(open_[gid]))))
            else:
                del open_[gid]
                core.group_finished(gid, [traj() for _ in range(gs)])
        if core.num_buffered_groups >= 2 and (not open_ or rng.random() < 0.3):
            core.request_batch(step)
            assert core.take_batch() is not None
    assert most_groups > 2  # groups in flight beyond max_inflight_groups: slots freed per trajectory


def test_a_miles_user_setting_max_concurrent_samples_gets_sample_counting():
    """``max_concurrent_samples`` in async mode derives ``sample`` (Miles' fully-async default); no Miles setting
    keeps RLinf's ``group``; sync mode stays ``group``; an explicit choice wins."""

    def gran(*o):
        return load_config(None, list(o)).rollout_buffer.submission_granularity

    assert gran("runner.async_mode=true") == "group"
    assert gran("runner.async_mode=true", "rollout_buffer.max_concurrent_samples=8") == "sample"
    assert gran("runner.async_mode=false", "rollout_buffer.max_concurrent_samples=8") == "group"
    assert gran("runner.async_mode=true", 'rollout_buffer.submission_granularity="sample"') == "sample"
    cfg = load_config(
        None, ["runner.async_mode=true", "rollout_buffer.max_concurrent_samples=8", "algorithm.group_size=4"]
    )
    s = CoreSettings.from_config(cfg)
    assert (s.submission_granularity, s.max_inflight_samples, s.max_inflight_groups) == ("sample", 8, 2)


def test_a_trajectory_budget_below_group_size_is_refused_and_an_ignored_group_limit_is_named():
    """``sample`` with max_concurrent_samples < group_size would never issue a group: a config error naming the
    key; an explicit max_inflight_groups next to max_concurrent_samples is not used under ``sample``: a warning."""
    from asyncrl.config import ConfigError
    from asyncrl.config.validate import validate

    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"  # async, with a task
    with pytest.raises(ConfigError, match=r"rollout_buffer.max_concurrent_samples: 3 is below algorithm.group_size"):
        validate(load_config(tiny, ["rollout_buffer.max_concurrent_samples=3", "algorithm.group_size=4"]))
    warnings = validate(
        load_config(tiny, ["rollout_buffer.max_concurrent_samples=8", "rollout_buffer.max_inflight_groups=5"])
    )
    assert any(w.startswith("rollout_buffer.max_inflight_groups = 5 is ignored") for w in warnings), warnings
