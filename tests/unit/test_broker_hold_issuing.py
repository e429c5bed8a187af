"""``hold_issuing`` / ``release_issuing``: a blocking eval on the shared engines stops new prompts only.

In-flight groups keep going (workers are not told to hold turns), finish and are buffered; nothing is
aborted; releasing re-checks admission at once. Independent of a sync's ``drain`` hold.
"""

from __future__ import annotations

from asyncrl.broker import protocol as P
from asyncrl.broker.core import BrokerCore, CoreSettings
from asyncrl.broker.types import PromptItem, Trajectory


def make(**kw):
    base = dict(
        rollout_batch_size=2,
        group_size=2,
        max_inflight_groups=3,
        max_buffered_groups=6,
        max_dropped_groups_per_step=100,
        seed=3,
    )
    base.update(kw)
    return BrokerCore([PromptItem(i, f"q{i}") for i in range(10)], settings=CoreSettings(**base), clock=lambda: 0.0)


def finish(core, gid):
    trajs = [Trajectory([1], [2, 3], [1, 1], [-0.1, -0.2], reward=1.0) for _ in range(core.s.group_size)]
    return core.group_finished(gid, trajs)


def test_hold_stops_new_prompts_but_not_turns_and_inflight_groups_are_buffered():
    core = make()
    core.add_worker("w", capacity=8)
    first = core.take_issues()
    assert len(first) == 3
    core.hold_issuing()
    assert core.issuing_held and not core.hold_new_turns  # workers keep taking turns
    assert finish(core, first[0].group_id) and finish(core, first[1].group_id)
    assert core.take_issues() == []  # capacity freed, but nothing new while held
    assert core.num_buffered_groups == 2 and core.num_inflight_groups == 1
    assert core.counters["dropped"] == 0  # nothing aborted or dropped
    core.request_batch(1)  # the actor may still take a batch of what was buffered
    assert [g.group_id for g in core.take_batch().groups] == [first[0].group_id, first[1].group_id]
    assert core.take_issues() == []
    core.release_issuing()
    assert not core.issuing_held
    assert len(core.take_issues()) == 2  # refilled at once up to max_inflight_groups


def test_hold_and_drain_sync_are_independent():
    core = make()
    core.add_worker("w", capacity=8)
    issues = core.take_issues()
    core.hold_issuing()
    core.sync_begin("drain")
    core.sync_end(1)  # the sync ends; the eval hold is still on
    finish(core, issues[0].group_id)
    assert core.take_issues() == [] and core.issuing_held
    core.sync_begin("drain")
    core.release_issuing()  # the eval ends during a drain sync: the sync still holds
    assert core.take_issues() == [] and core.hold_new_turns
    core.sync_end(2)
    assert len(core.take_issues()) == 1


def test_sync_mode_hold_defers_the_batch_issue():
    core = make(sync_mode=True)
    core.add_worker("w", capacity=8)
    core.hold_issuing()
    core.request_batch(1)
    assert core.take_issues() == []
    core.release_issuing()
    assert len(core.take_issues()) == 2


def test_protocol_messages_are_actor_types():
    for t in (P.HOLD_ISSUING, P.RELEASE_ISSUING):
        assert t in P.ACTOR_TYPES
        assert P.decode(P.encode(t), allowed=P.ACTOR_TYPES).type == t


def test_sample_filtered_groups_count_as_dropped_not_trained():
    core = make(rollout_batch_size=3)
    core.add_worker("w", capacity=8)
    first = core.take_issues()
    for g in first:
        assert finish(core, g.group_id)
    core.request_batch(1)
    batch = core.take_batch()
    ids = [g.group_id for g in batch.groups]
    assert core.counters["trained"] == 3
    core.batch_filtered([ids[1]])
    assert core.counters["trained"] == 2 and core.counters["dropped"] == 1
    assert core.counters["sample_filtered"] == 1
    issued = core.counters["issued"]
    held = core.num_inflight_groups + core.num_buffered_groups
    assert issued == core.counters["trained"] + core.counters["dropped"] + held + core.counters["reissued"]
    # only groups of the last batch, each once: a bad report is rejected and changes nothing
    for bad in ([ids[1]], [10_000], [ids[0], ids[0]]):
        try:
            core.batch_filtered(bad)
        except ValueError as e:
            assert "batch_filtered" in str(e)
        else:
            raise AssertionError(f"batch_filtered({bad}) was accepted")
    assert core.counters["trained"] == 2 and core.counters["dropped"] == 1


def test_batch_filtered_is_an_actor_message():
    assert P.BATCH_FILTERED in P.ACTOR_TYPES
