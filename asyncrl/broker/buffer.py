"""The data buffer: the store of finished groups between generation and training (Miles' contract).

Contract
- ``put(group) -> Rejection | None``: called once per finished group. The put-time filters live
  here: an aborted group is rejected with ``handler="unused"`` (the core applies
  ``rollout_buffer.unused_groups``: drop or retry); a dynamic-sampling filter that returns a reason
  rejects with ``handler="drop"`` (always dropped, counted as ``rollout/dynamic_filter/drop_<reason>``).
- ``get(num_groups, *, engine_version) -> (groups | None, rejections)``: called when the actor needs a
  batch. Staleness is Miles': ``engine_version - group.min_version``, the engines' current weight version
  minus the group's oldest (its stalest trajectory's) version. The get-time filter drops every group whose
  staleness exceeds the cap (``handler="unused"``); then, if at least ``num_groups`` remain, the **oldest**
  ``num_groups`` (arrival order) are removed and returned, else ``None`` (nothing else removed).
  This is Miles' per-group ``get()`` batched, so the core can hand a batch over atomically.
- ``get_metrics() -> dict``: what the buffer did since the previous call (one call per step):
  ``rollout/fully_async/*`` with the staleness above (RLinf's ``rollout/data_staleness/*``, computed by the
  core, is against the actor's version instead; they differ when ``rollout.update_weights_interval > 1``).
- ``__len__``, ``groups()`` (arrival order, for metrics and checkpoints) and ``restore(groups)``.

A custom buffer is named by ``rollout_buffer.custom_data_buffer_path = "module:Class"``. Two contracts
are accepted, told apart by ``buffer_plugin.buffer_interface`` (the dry run checks it, naming what is missing):
- this batched one: a ``DataBuffer`` subclass, constructed as ``Class(settings: BufferSettings)``;
- Miles' own (``asyncrl.broker.miles_buffer``): ``async def put(input: DataBufferInput)``,
  ``async def get() -> DataBufferInput``, ``get_metrics()``, constructed as
  ``Class(DataBufferConstructorInput(args, on_evict))``, run by ``MilesBufferAdapter``, which knows what it
  holds (so checkpoints keep its groups) and reports its evictions through ``take_evicted``.
Either takes over every group-level decision.

    buf = DefaultDataBuffer(BufferSettings(max_staleness=2))
    buf.put(group); groups, rejected = buf.get(8, engine_version=5)
"""

from __future__ import annotations

import abc
import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Optional

from asyncrl.broker.types import Group

DynamicFilter = Callable[[Group], Optional[str]]


@dataclass
class Rejection:
    """A group the buffer will not train on."""

    group: Group
    reason: str
    """``aborted``, ``stale`` or the dynamic filter's reason."""
    handler: Literal["unused", "drop"]
    """``unused``: the unused-groups handler decides (drop or retry); ``drop``: always dropped."""


@dataclass(frozen=True)
class BufferSettings:
    max_staleness: Optional[int] = None
    """``agentloop.max_actor_accept_staleness``; None = measured, not capped."""
    dynamic_filter: Optional[DynamicFilter] = None
    """Loaded from ``rollout_buffer.dynamic_sampling_filter_path``."""
    capacity: int = 0
    """``rollout_buffer.max_buffered_groups`` (informational: admission keeps the buffer below it)."""
    rollout_batch_size: int = 0
    """``data.rollout_batch_size`` (informational; Miles' ``args.rollout_batch_size``)."""
    group_size: int = 0
    """``algorithm.group_size`` (informational; Miles' ``args.n_samples_per_prompt``)."""
    unused_groups: str = "drop"
    """``rollout_buffer.unused_groups`` (informational: the core applies it to ``handler="unused"``)."""
    extra: dict = field(default_factory=dict)


class DataBuffer(abc.ABC):
    def __init__(self, settings: BufferSettings):
        self.settings = settings

    @abc.abstractmethod
    def put(self, group: Group) -> Optional[Rejection]: ...

    @abc.abstractmethod
    def get(self, num_groups: int, *, engine_version: int) -> tuple[Optional[list[Group]], list[Rejection]]: ...

    @abc.abstractmethod
    def get_metrics(self) -> dict[str, float]: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def groups(self) -> list[Group]:
        """Buffered groups, oldest first."""

    @abc.abstractmethod
    def restore(self, groups: list[Group]) -> None:
        """Replace the content with ``groups`` (oldest first), e.g. from a checkpoint."""

    def take_evicted(self) -> list[Rejection]:
        """Groups given up since the last call other than by ``put``'s and ``get``'s own results (a Miles buffer's
        ``on_evict``); the core asks after every ``put``, ``get`` and ``restore``."""
        return []


class DefaultDataBuffer(DataBuffer):
    """FIFO store with the put-time and get-time filters of the Miles page.

    ``put`` is O(group + log n); ``get`` is O(log n) while nothing is too stale and fewer than ``num_groups``
    are buffered (the core asks after every arrival while the actor waits), else O(what it removes + log n)
    (O(n) when it drops stale groups): the min version is kept in a heap, the sum of versions as a total."""

    def __init__(self, settings: BufferSettings):
        super().__init__(settings)
        self._q: deque[Group] = deque()
        self._min_version: dict[int, int] = {}  # group_id -> group.min_version, computed once at put
        self._version_heap: list[tuple[int, int]] = []  # (min_version, group_id); stale once the id left _min_version
        self._version_sum = 0  # sum of _min_version's values
        self._reset_step()

    def _reset_step(self) -> None:
        self._aborted = 0
        self._stale = 0
        self._filter_drops: dict[str, int] = {}
        self._consumed: list[int] = []
        self._buffer_staleness: tuple[float, int] = (0.0, 0)  # (mean, max) after the last get
        self._queue_size = len(self._q) if hasattr(self, "_q") else 0

    def put(self, group: Group) -> Optional[Rejection]:
        trajs = group.trajectories
        if group.aborted or any([t.aborted for t in trajs]):
            self._aborted += 1
            return Rejection(group, "aborted", "unused")
        flt = self.settings.dynamic_filter
        if flt is not None:
            reason = flt(group)
            if reason is not None:
                reason = str(reason)
                self._filter_drops[reason] = self._filter_drops.get(reason, 0) + 1
                return Rejection(group, reason, "drop")
        self._q.append(group)
        self._remember(group.group_id, min([t.min_version for t in trajs]) if trajs else group.min_version)
        return None

    def _remember(self, group_id: int, min_version: int) -> None:
        self._min_version[group_id] = min_version
        self._version_sum += min_version
        heapq.heappush(self._version_heap, (min_version, group_id))

    def _forget(self, group_id: int) -> int:
        v = self._min_version.pop(group_id)
        self._version_sum -= v
        return v

    def _oldest_version(self) -> int:
        """min(_min_version.values()) in O(log n) amortized; the buffer must not be empty."""
        heap, mv = self._version_heap, self._min_version
        while heap[0][1] not in mv:
            heapq.heappop(heap)
        return heap[0][0]

    def get(self, num_groups: int, *, engine_version: int) -> tuple[Optional[list[Group]], list[Rejection]]:
        rejected: list[Rejection] = []
        cap = self.settings.max_staleness
        mv = self._min_version
        if cap is not None and self._q and engine_version - self._oldest_version() > cap:
            kept: deque[Group] = deque()
            for g in self._q:
                if engine_version - mv[g.group_id] > cap:
                    rejected.append(Rejection(g, "stale", "unused"))
                    self._forget(g.group_id)
                else:
                    kept.append(g)
            self._q = kept
            self._stale += len(rejected)
        if len(self._q) < num_groups:
            return None, rejected
        self._queue_size = len(self._q)
        pop = self._q.popleft
        out = [pop() for _ in range(num_groups)]
        self._consumed.extend([engine_version - self._forget(g.group_id) for g in out])
        if len(self._version_heap) > 2 * len(mv) + 64:  # compact: O(n) per >= n + 64 removals
            self._version_heap = [(v, gid) for gid, v in mv.items()]
            heapq.heapify(self._version_heap)
        # staleness of what stays buffered: mean and max from the maintained total and heap
        self._buffer_staleness = (
            (engine_version - self._version_sum / len(mv), engine_version - self._oldest_version()) if mv else (0.0, 0)
        )
        return out, rejected

    def get_metrics(self) -> dict[str, float]:
        def avg(xs):
            return sum(xs) / len(xs) if xs else 0.0

        p = "rollout/fully_async/"
        m = {
            p + "queue_size": float(self._queue_size),
            p + "aborted_groups_filtered": float(self._aborted),
            p + "stale_groups_filtered": float(self._stale),
            p + "avg_staleness": avg(self._consumed),
            p + "max_staleness": float(max(self._consumed, default=0)),
            p + "buffer_avg_staleness": float(self._buffer_staleness[0]),
            p + "buffer_max_staleness": float(self._buffer_staleness[1]),
        }
        for reason, n in sorted(self._filter_drops.items()):
            m[f"rollout/dynamic_filter/drop_{reason}"] = float(n)
        self._reset_step()
        return m

    def __len__(self) -> int:
        return len(self._q)

    def groups(self) -> list[Group]:
        return list(self._q)

    def restore(self, groups: list[Group]) -> None:
        self._q = deque(groups)
        self._min_version, self._version_heap, self._version_sum = {}, [], 0
        for g in groups:
            self._remember(g.group_id, g.min_version)
