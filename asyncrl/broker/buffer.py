"""The data buffer: the store of finished groups between generation and training (Miles' contract).

Contract
- ``put(group) -> Rejection | None``: called once per finished group. The put-time filters live
  here: an aborted group is rejected with ``handler="unused"`` (the core applies
  ``rollout_buffer.unused_groups``: drop or retry); a dynamic-sampling filter that returns a reason
  rejects with ``handler="drop"`` (always dropped, counted as ``rollout/dynamic_filter/drop_<reason>``).
- ``get(num_groups, *, actor_version) -> (groups | None, rejections)``: called when the actor needs a
  batch. The get-time filter drops every group whose staleness (``actor_version - group.min_version``)
  exceeds the cap (``handler="unused"``); then, if at least ``num_groups`` remain, the **oldest**
  ``num_groups`` (arrival order) are removed and returned, else ``None`` (nothing else removed).
  This is Miles' per-group ``get()`` batched, so the core can hand a batch over atomically.
- ``get_metrics() -> dict``: what the buffer did since the previous call (one call per step).
- ``__len__``, ``groups()`` (arrival order, for metrics and checkpoints) and ``restore(groups)``.

A custom buffer is named by ``rollout_buffer.custom_data_buffer_path = "module:Class"``; the class
is constructed as ``Class(settings: BufferSettings)`` and takes over every group-level decision.

    buf = DefaultDataBuffer(BufferSettings(max_staleness=2))
    buf.put(group); groups, rejected = buf.get(8, actor_version=5)
"""

from __future__ import annotations

import abc
import importlib
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
    extra: dict = field(default_factory=dict)


def staleness(group: Group, actor_version: int) -> int:
    """Actor version at the start of the step - the earliest version any token was generated with."""
    return actor_version - group.min_version


class DataBuffer(abc.ABC):
    def __init__(self, settings: BufferSettings):
        self.settings = settings

    @abc.abstractmethod
    def put(self, group: Group) -> Optional[Rejection]: ...

    @abc.abstractmethod
    def get(self, num_groups: int, *, actor_version: int) -> tuple[Optional[list[Group]], list[Rejection]]: ...

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


class DefaultDataBuffer(DataBuffer):
    """FIFO store with the put-time and get-time filters of the Miles page."""

    def __init__(self, settings: BufferSettings):
        super().__init__(settings)
        self._q: deque[Group] = deque()
        self._min_version: dict[int, int] = {}  # group_id -> group.min_version, computed once at put
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
        self._min_version[group.group_id] = min([t.min_version for t in trajs]) if trajs else group.min_version
        return None

    def get(self, num_groups: int, *, actor_version: int) -> tuple[Optional[list[Group]], list[Rejection]]:
        rejected: list[Rejection] = []
        cap = self.settings.max_staleness
        mv = self._min_version
        if cap is not None and self._q and actor_version - min(mv.values()) > cap:
            kept: deque[Group] = deque()
            for g in self._q:
                if actor_version - mv[g.group_id] > cap:
                    rejected.append(Rejection(g, "stale", "unused"))
                    del mv[g.group_id]
                else:
                    kept.append(g)
            self._q = kept
            self._stale += len(rejected)
        if len(self._q) < num_groups:
            return None, rejected
        self._queue_size = len(self._q)
        pop = self._q.popleft
        out = [pop() for _ in range(num_groups)]
        self._consumed.extend([actor_version - mv.pop(g.group_id) for g in out])
        # staleness of what stays buffered: mean and max from the cached min versions (no per-group objects)
        self._buffer_staleness = (actor_version - sum(mv.values()) / len(mv), actor_version - min(mv.values())) \
            if mv else (0.0, 0)
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
        self._min_version = {g.group_id: g.min_version for g in groups}


def import_path(path: str, key: str):
    """Resolve ``module:attr`` (``key`` is the dotted config key, for the error message)."""
    if ":" not in path:
        raise ValueError(f"{key}: expected 'module:name', got {path!r}")
    mod_name, attr = path.split(":", 1)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"{key}: cannot import module {mod_name!r} of {path!r}: {e}") from None
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}: module {mod_name!r} has no attribute {attr!r} (from {path!r})")
        obj = getattr(obj, part)
    return obj


def make_data_buffer(settings: BufferSettings, custom_path: Optional[str]) -> DataBuffer:
    if custom_path is None:
        return DefaultDataBuffer(settings)
    cls = import_path(custom_path, "rollout_buffer.custom_data_buffer_path")
    if not (isinstance(cls, type) and issubclass(cls, DataBuffer)):
        raise ValueError(f"rollout_buffer.custom_data_buffer_path: {custom_path!r} is not a DataBuffer subclass "
                         f"(asyncrl.broker.buffer.DataBuffer)")
    return cls(settings)
