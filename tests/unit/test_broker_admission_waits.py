"""The two admission-wait fractions are exclusive: a second both limits block counts once, as buffer full.

Driven on the pure broker core with an injected clock (no sockets, no sleeps): the step's waits are read
from the hand-off's metrics.
"""

from __future__ import annotations

import pytest

from asyncrl.broker.core import BrokerCore, CoreSettings
from asyncrl.broker.types import PromptItem, Trajectory

WAIT_INFLIGHT = "rollout/buffer/admission_wait_inflight_limit"
WAIT_BUFFER = "rollout/buffer/admission_wait_buffer_full"


def _core(t: list[float]) -> BrokerCore:
    s = CoreSettings(
        rollout_batch_size=2,
        group_size=2,
        max_inflight_groups=2,
        max_buffered_groups=4,
        max_dropped_groups_per_step=100,
        seed=0,
    )
    return BrokerCore([PromptItem(i, f"q{i}") for i in range(20)], settings=s, clock=lambda: t[0])


def _finish(core: BrokerCore, gid: int) -> None:
    trajs = [Trajectory([0, 1], [2, 3], [1, 1], [-0.5, -0.5], reward=1.0) for _ in range(core.s.group_size)]
    core.group_finished(gid, trajs, aborted=False)


def test_both_limits_blocking_count_once_as_buffer_full():
    """0-7 s: 2 in flight (the in-flight limit) and room in the buffer; 7-10 s: 2 in flight + 2 buffered = 4
    (both limits block at once). The 3 s of both count as buffer full only: 0.7 + 0.3, not 1.0 + 0.3."""
    t = [0.0]
    core = _core(t)
    core.add_worker("w", capacity=8)
    first = core.take_issues()
    assert len(first) == 2  # the in-flight limit binds, the buffer (2 of 4) does not
    t[0] = 6.0
    _finish(core, first[0].group_id)  # 1 buffered + 1 in flight: one more issued, 2 in flight again
    assert len(core.take_issues()) == 1
    t[0] = 7.0
    _finish(core, first[1].group_id)  # 2 buffered + 1 in flight: one more issued -> 2 + 2 = 4, both block
    assert len(core.take_issues()) == 1
    assert core.num_inflight_groups == 2 and core.num_buffered_groups == 2
    assert not core._inflight_ok() and not core._buffer_ok()
    t[0] = 10.0
    core.request_batch(0)
    m = core.take_batch().metrics
    assert m[WAIT_INFLIGHT] == pytest.approx(0.7)
    assert m[WAIT_BUFFER] == pytest.approx(0.3)
    assert m[WAIT_INFLIGHT] + m[WAIT_BUFFER] <= 1.0 + 1e-9


def test_a_step_blocked_throughout_by_both_is_all_buffer_full():
    t = [0.0]
    core = _core(t)
    core.add_worker("w", capacity=8)
    for iss in core.take_issues():
        _finish(core, iss.group_id)
    core.take_issues()  # two more: 2 in flight + 2 buffered, both limits block from t = 0
    assert not core._inflight_ok() and not core._buffer_ok()
    t[0] = 5.0
    core.request_batch(0)
    m = core.take_batch().metrics
    assert (m[WAIT_INFLIGHT], m[WAIT_BUFFER]) == (pytest.approx(0.0), pytest.approx(1.0))
