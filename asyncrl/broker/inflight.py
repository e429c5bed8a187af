"""The broker core's in-flight groups: issued to a worker, not yet back (pure, part of ``BrokerCore``).

``InflightTable`` keeps each group by id and, through the ``WorkerPool``, by worker, with the two counts
admission reads in O(1): groups in flight and trajectories outstanding (``sample`` granularity's budget;
each finished trajectory frees its slot). ``assemble`` turns a group that came back into the buffer's
``Group``, treating a malformed group or a non-finite reward as aborted (never trained on).

    table = InflightTable(pool)
    table.add(0, item, 0, "w0", w, 0, 4)   # group 0, epoch 0, worker w0, version 0, 4 trajectories
    table.trajectory_done(table.groups[0], 2, traj, t=1.0)   # True: a slot freed
    g = table.pop(0, t=2.0); group, problem = assemble(g, None, False, group_size=4, version=0)
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Optional

from asyncrl.broker.types import Group, PromptItem, Trajectory
from asyncrl.broker.workers import WorkerPool, WorkerState

log = logging.getLogger("asyncrl.broker")


@dataclass(slots=True)
class InflightGroup:
    group_id: int
    item: PromptItem
    epoch: int
    worker_id: str
    issued_version: int
    outstanding: int
    """Trajectories not yet reported finished."""
    trajectories: dict[int, Trajectory] = field(default_factory=dict)


class InflightTable:
    def __init__(self, pool: WorkerPool):
        self.pool = pool
        self.groups: dict[int, InflightGroup] = {}
        self.samples = 0
        """Trajectories issued and not yet reported finished, over all groups."""

    def __len__(self) -> int:
        return len(self.groups)

    def add(
        self, group_id: int, item: PromptItem, epoch: int, worker_id: str, worker: WorkerState, version: int, size: int
    ) -> None:
        """Issue group ``group_id`` of ``size`` trajectories to a worker (positional: once per issued group)."""
        self.groups[group_id] = InflightGroup(group_id, item, epoch, worker_id, version, size)
        worker.groups.add(group_id)
        worker.outstanding += size
        self.samples += size
        self.pool.push_load(worker_id, worker)

    def trajectory_done(self, g: InflightGroup, index: int, trajectory: Optional[Trajectory], *, t: float) -> None:
        """A trajectory of ``g`` finished: its slot frees once (a report again may only fill in the trajectory)."""
        w = self.pool.workers[g.worker_id]
        self.pool.seen(g.worker_id, w, t)
        if index not in g.trajectories:
            g.trajectories[index] = trajectory
            g.outstanding -= 1
            self.samples -= 1
            w.outstanding -= 1
            self.pool.dirty.add(g.worker_id)
        elif trajectory is not None:
            g.trajectories[index] = trajectory

    def pop(self, group_id: int, *, t: float) -> InflightGroup:
        """The group came back (its worker was seen at ``t``): out of the table and off its worker's load."""
        g = self.groups.pop(group_id)
        w = self.pool.workers[g.worker_id]
        self.pool.seen(g.worker_id, w, t)
        self._release(g, w)
        return g

    def take_worker(self, w: WorkerState) -> list[InflightGroup]:
        """The groups of a worker that left (already out of the pool), by group id."""
        out = [self.groups.pop(gid) for gid in sorted(w.groups)]
        self.samples -= sum(g.outstanding for g in out)
        return out

    def cancel_all(self) -> list[tuple[str, int]]:
        """Empty the table (a checkpoint is restored); (worker id, group id) of every group cancelled."""
        out = []
        for gid, g in self.groups.items():
            out.append((g.worker_id, gid))
            w = self.pool.workers[g.worker_id]
            self._release(g, w)
            self.pool.push_load(g.worker_id, w)
        self.groups.clear()
        self.samples = 0
        return out

    def _release(self, g: InflightGroup, w: WorkerState) -> None:
        self.samples -= g.outstanding
        w.groups.discard(g.group_id)
        if g.outstanding:
            w.outstanding -= g.outstanding
            self.pool.dirty.add(g.worker_id)


def assemble(
    g: InflightGroup, trajectories: Optional[list[Trajectory]], aborted: bool, *, group_size: int, version: int
) -> tuple[Group, Optional[str]]:
    """The buffer's ``Group`` for a group that came back (``trajectories=None``: the ones reported one by one),
    and the counter of what made it aborted here (``malformed_groups``, ``nonfinite_rewards``) or None."""
    problem = None
    if trajectories is None:
        trajectories = [g.trajectories[i] for i in sorted(g.trajectories) if g.trajectories[i] is not None]
    if not aborted and len(trajectories) != group_size:
        log.warning(
            "group %d came back with %d trajectories, expected group_size = %d; treating it as aborted",
            g.group_id,
            len(trajectories),
            group_size,
        )
        problem, aborted = "malformed_groups", True
    if not aborted and not all(math.isfinite(t.reward) for t in trajectories):
        log.warning(
            "group %d came back with a non-finite reward %s; not trained on (dropped as aborted)",
            g.group_id,
            [t.reward for t in trajectories],
        )
        problem, aborted = "nonfinite_rewards", True
    group = Group(g.group_id, g.item, g.epoch, list(trajectories), g.issued_version, 0, aborted)
    mx = g.issued_version if not trajectories else max([t.max_version for t in trajectories])
    group.finished_version = version if version > mx else mx
    return group, problem
