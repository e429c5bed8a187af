"""The broker core's agent workers: who joined, how loaded each is, who went silent (pure, no clock).

Part of ``BrokerCore`` (``core.py``), which alone calls it. Each event is O(1) or O(log workers)
amortized: the least-loaded worker comes from a heap with lazy deletion (an entry is current iff
its stamp is the worker's), and workers are kept in last-seen order, so the heartbeat expiry reads
from the front and stops at the first worker still alive.

Start-up (``joining``): while fewer than ``expected_workers`` have joined, and for at most
``join_grace_s`` after the first join, the core issues nothing to a worker at or past its capacity.

    pool = WorkerPool(expected_workers=2, join_grace_s=60.0)
    w = pool.join("w0", capacity=32, t=0.0); w.outstanding += 4; pool.push_load("w0", w)
    pool.least_loaded()   # ('w0', WorkerState(capacity=32, ...))
"""

from __future__ import annotations

import heapq
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

log = logging.getLogger("asyncrl.broker")

HEAP_SLACK = 64  # stale heap entries tolerated beyond 2 x workers before a compaction (amortizes it at few workers)


@dataclass(slots=True)
class WorkerState:
    capacity: int
    last_seen: float
    groups: set[int] = field(default_factory=set)
    outstanding: int = 0
    """Trajectories issued to it and not yet reported finished."""
    stamp: int = 0
    """Of its current entry in the load heap (older entries are stale)."""


class WorkerPool:
    def __init__(self, *, expected_workers: int, join_grace_s: float):
        self.workers: dict[str, WorkerState] = {}
        self.by_seen: OrderedDict[str, None] = OrderedDict()
        """Worker ids, least recently seen first (the clock is monotonic): ``silent`` reads from the front."""
        self.load_heap: list[tuple[float, str, int]] = []
        """(outstanding / capacity, worker id, stamp); an entry is current iff its stamp is the worker's."""
        self._stamp = 0
        self.dirty: set[str] = set()
        """Workers whose load changed since their heap entry was pushed (pushed before the next choice)."""
        self.expected = expected_workers
        self.join_grace_s = join_grace_s
        self.joining = expected_workers > 1
        """Start-up: no worker is issued past its capacity; False for good once over."""
        self._first_join_t: Optional[float] = None

    def __len__(self) -> int:
        return len(self.workers)

    def join(self, worker_id: str, *, capacity: int, t: float) -> WorkerState:
        """A worker says hello (again: its capacity is updated)."""
        w = self.workers.get(worker_id)
        if w is None:
            w = self.workers[worker_id] = WorkerState(capacity=max(1, capacity), last_seen=t)
            self.by_seen[worker_id] = None
        w.capacity = max(1, capacity)
        self.seen(worker_id, w, t)
        self.push_load(worker_id, w)
        if self._first_join_t is None:
            self._first_join_t = t
        return w

    def leave(self, worker_id: str) -> Optional[WorkerState]:
        """Forget a worker (its load-heap entries go stale: no such worker); None if unknown."""
        w = self.workers.pop(worker_id, None)
        if w is not None:
            del self.by_seen[worker_id]
        return w

    def seen(self, worker_id: str, w: WorkerState, t: float) -> None:
        w.last_seen = t
        self.by_seen.move_to_end(worker_id)

    def silent(self, now: float, timeout_s: float) -> list[str]:
        """Workers not seen for more than ``timeout_s``, least recently seen first."""
        out = []
        for wid in self.by_seen:  # least recently seen first: stop at the first one still alive
            if now - self.workers[wid].last_seen <= timeout_s:
                break
            out.append(wid)
        return out

    def push_load(self, worker_id: str, w: WorkerState) -> None:
        """The worker's load changed: a new current heap entry (the old one goes stale)."""
        self._stamp += 1
        w.stamp = self._stamp
        heap = self.load_heap
        heapq.heappush(heap, (w.outstanding / w.capacity, worker_id, w.stamp))
        if len(heap) > 2 * len(self.workers) + HEAP_SLACK:  # compact: O(workers) per >= workers + 64 pushes
            heap[:] = [(x.outstanding / x.capacity, wid, x.stamp) for wid, x in self.workers.items()]
            heapq.heapify(heap)

    def least_loaded(self) -> tuple[str, WorkerState]:
        """min over workers of (outstanding / capacity, worker id); stale heap entries are dropped on the way."""
        heap, workers = self.load_heap, self.workers
        if self.dirty:
            for wid in self.dirty:
                w = workers.get(wid)
                if w is not None:
                    self.push_load(wid, w)
            self.dirty.clear()
        while True:
            _, wid, stamp = heap[0]
            w = workers.get(wid)
            if w is not None and w.stamp == stamp:
                return wid, w
            heapq.heappop(heap)

    def still_joining(self, now: float) -> bool:
        """The start-up phase ends once ``expected_workers`` joined or the grace ran out (for good)."""
        if self.joining and (
            len(self.workers) >= self.expected
            or self._first_join_t is not None
            and now - self._first_join_t > self.join_grace_s
        ):
            self.joining = False
            log.info(
                "%d of %d expected workers joined: workers may now be issued past their capacity",
                len(self.workers),
                self.expected,
            )
        return self.joining
