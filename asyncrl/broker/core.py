# long: one class read top to bottom: events in, admission, the hand-off, the checkpoint
"""The broker's pure core: dataloader, the two admission limits, the buffer, staleness, drops, metrics.

No sockets, no threads: time comes from an injected ``clock`` and every decision is a method call.
The ZeroMQ server (``server.py``), the simulator (``asyncrl.simulate``) and the tests drive this same
class. ``BrokerCore`` is one class and alone changes its state; it owns its parts, each pure, which
never reach back into it: ``core_types`` (settings, outputs, errors), ``dataloader``, ``buffer`` (the
``DataBuffer``), ``workers`` (the worker pool: load heap, last-seen order, start-up), ``inflight``
(groups in flight, a returned group's assembly), ``step_meter`` (one step's figures) and ``autotune``
(the in-flight limit's controller). The class reads top to bottom: read-only state, outputs for the
shell, workers, worker results, the actor (batch requests, syncs, holds, engine figures), the tick,
the checkpoint; then the internals: admission, drops, the hand-off.

Contract
- Wires: ``Dataloader`` (prompts) -> admission -> agent workers (``take_issues``) -> finished groups
  (``group_finished``) -> ``DataBuffer`` -> the actor's batch (``request_batch`` / ``take_batch``).
- Admission issues a group only while both limits hold (re-checked after every event: a group
  arrives, a group is dropped, a batch is handed over, a trajectory finishes, a worker joins or a
  sync ends):
    in-flight limit  ``group`` (RLinf's counting, the default): inflight_groups < max_inflight_groups; a group
                     holds its slot until its last trajectory returns.
                     ``sample`` (Miles' counting, when asked for): inflight_samples + group_size <= budget,
                     budget = max_inflight_samples (``rollout_buffer.max_concurrent_samples``), unset (or
                     autotuned): max_inflight_groups * group_size; ``inflight_samples`` = trajectories issued
                     and not yet reported finished, so each finished trajectory frees its own slot and a new
                     group goes out once group_size have finished, whichever groups they came from; the
                     number of groups in flight is bounded by the buffer limit alone.
    buffer limit     inflight_groups + buffered_groups < max_buffered_groups
  so ``inflight_groups + buffered_groups <= max_buffered_groups`` always holds. The time admission is
  blocked counts once (``rollout/buffer/admission_wait_*``, exclusive, summing to <= 1): to the buffer
  limit whenever it is full (room in flight would admit nothing; training sets the pace), else to the
  in-flight limit.
  With ``inflight_autotune`` (``max_inflight_groups = "auto"``) the in-flight limit starts at
  ``max_inflight_groups`` and ``autotune.InflightAutotuner`` moves it at every hand-off, within
  ``[1, max_buffered_groups - rollout_batch_size]``; the shell may report the engines' figures
  (``engine_figures``), else the tokens of arriving groups measure the throughput.
- Hand-off: the oldest ``rollout_batch_size`` buffered groups (arrival order), after the get-time
  staleness filter (Miles: engines' current version - group.min_version, the stalest trajectory's).
  RLinf's staleness (``rollout/data_staleness/*``) = actor version at the start of the step - group.min_version;
  it splits exactly into version_span = finished_version - min_version (versions that passed while
  the group generated; finished_version = max(broker version at arrival, group.max_version)) and
  queue_steps = actor version - finished_version (versions it waited in the buffer).
- Unused groups (aborted at put time, too stale at get time): ``drop`` -> the prompt comes back in
  the next epoch (every epoch visits every prompt); ``retry`` -> re-queued at once (same epoch).
  Dynamic-filter rejects are always dropped; groups a buffer gives up on its own (a Miles buffer's
  ``on_evict``, read from ``take_evicted`` after every put, get and restore) are unused groups. More than ``max_dropped_groups_per_step`` drops
  between two hand-offs sets ``failure`` (a ``TooManyDropsError``) and stops issuing; the next
  ``request_batch`` / ``take_batch`` raises it.
- Each group goes to the least-loaded worker (outstanding trajectories / capacity, ties by worker id).
  Start-up: while fewer than ``expected_workers`` (the run's engines) have joined, and for at most
  ``worker_join_grace_s`` after the first join, a worker at or past its capacity is issued nothing more
  (else the first worker to say hello takes the whole first burst and keeps it queued while the others
  idle); the limits' remaining room is issued as the others join. ``expected_workers = 0``: no wait.
- A worker that misses heartbeats (``tick``) or leaves has its in-flight groups re-issued (same
  prompt and epoch, new group_id); late reports for old group ids are ignored and counted.
- Cost: every event is O(1) or O(log workers) amortized, plus the work it carries (the groups it
  issues, the trajectories it reports, the batch it hands over): the least-loaded worker comes from a
  heap with lazy deletion, workers are kept in last-seen order for the heartbeat expiry, and the
  buffer keeps its min version in a heap. ``inflight_group_ids``, ``held``, ``workers`` and
  ``state_dict`` are O(n) inspections (``is_inflight`` / ``owner`` are the per-event queries).
- Sync mode (``runner.async_mode = false``): nothing is issued unless a batch request is pending,
  and then only up to ``rollout_batch_size - inflight - buffered`` groups: exactly one batch, plus
  replacements for drops. ``sync_begin("drain")`` pauses issuing until ``sync_end(version)``.
- A group with a non-finite reward (NaN, inf) is never trained on: it counts as ``nonfinite_rewards``
  and is dropped like an aborted group (``rollout_buffer.unused_groups`` decides drop or retry).
- ``batch_filtered(group_ids)``: the trainer's sample filter removed these groups of the last
  batch; they move from ``trained`` to ``dropped`` in the counters.
- ``hold_issuing()`` / ``release_issuing()`` (a blocking eval on the shared engines): no new prompt
  is issued while held; in-flight groups go on (new turns too), finish and are buffered; nothing is
  aborted. Independent of a sync's ``drain`` hold.
- Checkpoint: ``state_dict`` / ``load_state_dict``; ``validate_state`` checks a state whole before
  anything changes, so a bad state raises ``ValueError`` naming the field and leaves the core as it was.

    core = BrokerCore(prompts, settings=CoreSettings(rollout_batch_size=8, group_size=4,
                      max_inflight_groups=10, max_buffered_groups=16, max_dropped_groups_per_step=80),
                      clock=time.monotonic)
    core.add_worker("w0", capacity=32); issues = core.take_issues()
    core.group_finished(issues[0].group_id, trajectories); core.request_batch(step=0); core.take_batch()
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from asyncrl.broker.autotune import TRAINING, InflightAutotuner, binding_side
from asyncrl.broker.buffer import (
    BufferSettings,
    DataBuffer,
    DefaultDataBuffer,
    Rejection,
)
from asyncrl.broker.buffer_plugin import import_path, make_data_buffer
from asyncrl.broker.core_types import (
    Batch,
    BrokerError,
    CoreSettings,
    Drop,
    Issue,
    TooManyDropsError,
    too_many_drops_message,
)
from asyncrl.broker.dataloader import Dataloader
from asyncrl.broker.inflight import InflightTable, assemble
from asyncrl.broker.step_meter import StepMeter
from asyncrl.broker.types import Group, PromptItem, Trajectory
from asyncrl.broker.workers import WorkerPool

# the core's public names; settings, outputs and errors live in core_types
__all__ = ["Batch", "BrokerCore", "BrokerError", "CoreSettings", "Drop", "Issue", "TooManyDropsError", "validate_state"]

log = logging.getLogger("asyncrl.broker")


@dataclass
class BatchRequest:
    """The actor's pending request for a step's batch (``t``: when it began waiting)."""

    step: int
    actor_version: int
    t: float


class BrokerCore:
    def __init__(
        self,
        prompts: list[PromptItem],
        *,
        settings: CoreSettings,
        clock: Callable[[], float],
        data_buffer: Optional[DataBuffer] = None,
    ):
        s = settings
        assert s.rollout_batch_size <= s.max_buffered_groups, "validate(): max_buffered_groups >= rollout_batch_size"
        self.s = settings
        self.clock = clock
        self.dataloader = Dataloader(prompts, seed=s.seed, shuffle=s.shuffle)
        self.buffer = data_buffer if data_buffer is not None else _default_buffer(s)
        self.version = 0
        self.num_skipped_long_prompts = 0  # data.max_prompt_tokens (set by the server)
        self.failure: Optional[BrokerError] = None
        self._pool = WorkerPool(expected_workers=s.expected_workers, join_grace_s=s.worker_join_grace_s)
        self._inflight = InflightTable(self._pool)
        self._retry: deque[tuple[PromptItem, int]] = deque()
        self._next_group_id = 0
        self._paused = False
        self._issuing_held = False
        self._request: Optional[BatchRequest] = None
        self._withdrawn: Optional[BatchRequest] = None
        """The last request withdrawn by ``cancel_request``: asking again for the same step continues it."""
        self._batch: Optional[Batch] = None
        self._issues: list[Issue] = []
        self._drops: list[Drop] = []
        self._cancelled: list[tuple[str, int]] = []
        now = clock()
        self._last_t = now
        self._last_arrival_t = now
        self._last_warning_t = now
        self.counters: Counter[str] = Counter()
        """Lifetime totals: issued, finished, trained, dropped, retried, reissued, unknown_reports, ..."""
        self._last_batch_ids: list[int] = []
        """Group ids of the last batch handed out (``batch_filtered`` may remove only those)."""
        self.last_metrics: dict[str, float] = {}
        self.inflight_limit = s.max_inflight_groups
        self.autotuner = (
            InflightAutotuner(start=s.max_inflight_groups, upper=max(1, s.max_buffered_groups - s.rollout_batch_size))
            if s.inflight_autotune
            else None
        )
        self._engines: Optional[tuple[float, float, float]] = None
        self._side: Optional[str] = None  # the side that set the pace, as last logged (auto)
        self._meter = StepMeter(now=now)

    # ----------------------------------------------------------------- read-only state
    @property
    def num_inflight_groups(self) -> int:
        return len(self._inflight)

    @property
    def num_inflight_samples(self) -> int:
        return self._inflight.samples

    @property
    def num_buffered_groups(self) -> int:
        return len(self.buffer)

    @property
    def hold_new_turns(self) -> bool:
        """True during a ``drain`` sync: workers must not start new turns."""
        return self._paused

    @property
    def issuing_held(self) -> bool:
        """True between ``hold_issuing`` and ``release_issuing``: no new prompts are issued."""
        return self._issuing_held

    @property
    def waiting_step(self) -> Optional[int]:
        return None if self._request is None else self._request.step

    def workers(self) -> dict[str, int]:
        """worker id -> in-flight groups."""
        return {w: len(ws.groups) for w, ws in self._pool.workers.items()}

    def held(self) -> list[tuple[int, int]]:
        """(epoch, prompt index) of every prompt issued or queued and not yet trained or dropped."""
        out = [(e, it.index) for it, e in self._retry]
        out += [(g.epoch, g.item.index) for g in self._inflight.groups.values()]
        out += [(g.epoch, g.item.index) for g in self.buffer.groups()]
        return out

    def inflight_group_ids(self) -> list[int]:
        """O(in-flight): for inspection and tests; per event, ask ``is_inflight``."""
        return list(self._inflight.groups)

    def is_inflight(self, group_id: int) -> bool:
        return group_id in self._inflight.groups

    def owner(self, group_id: int) -> Optional[str]:
        """The worker an in-flight group was issued to (None when it is not in flight)."""
        g = self._inflight.groups.get(group_id)
        return None if g is None else g.worker_id

    # ----------------------------------------------------------------- outputs for the shell
    def take_issues(self) -> list[Issue]:
        out, self._issues = self._issues, []
        return out

    def take_drops(self) -> list[Drop]:
        out, self._drops = self._drops, []
        return out

    def take_cancelled(self) -> list[tuple[str, int]]:
        """(worker id, group id) of groups the worker should stop (after ``load_state_dict``)."""
        out, self._cancelled = self._cancelled, []
        return out

    def take_batch(self) -> Optional[Batch]:
        if self.failure is not None:
            raise self.failure
        out, self._batch = self._batch, None
        return out

    # ----------------------------------------------------------------- workers
    def add_worker(self, worker_id: str, *, capacity: int) -> None:
        self._advance()
        self._pool.join(worker_id, capacity=capacity, t=self._last_t)
        self._admit()

    def heartbeat(self, worker_id: str) -> bool:
        """False for a worker the core does not know (it must say hello again)."""
        w = self._pool.workers.get(worker_id)
        if w is None:
            return False
        self._pool.seen(worker_id, w, self.clock())
        return True

    def remove_worker(self, worker_id: str) -> list[int]:
        """Forget a worker; its in-flight groups are re-queued first. Returns their old group ids."""
        self._advance()
        w = self._pool.leave(worker_id)
        if w is None:
            return []
        groups = self._inflight.take_worker(w)
        self._retry.extendleft((g.item, g.epoch) for g in reversed(groups))
        gone = [g.group_id for g in groups]
        self.counters["reissued"] += len(gone)
        self._meter.counts["reissued"] += len(gone)
        if gone:
            log.warning("worker %s left with %d in-flight groups; re-issuing them", worker_id, len(gone))
        self._admit()
        return gone

    # ----------------------------------------------------------------- worker results
    def trajectory_finished(self, group_id: int, index: int, trajectory: Optional[Trajectory] = None) -> bool:
        """One trajectory of a group finished (frees its slot under ``sample`` granularity)."""
        g = self._inflight.groups.get(group_id)
        if g is None or not (0 <= index < self.s.group_size):
            self.counters["unknown_reports"] += 1
            return False
        self._advance()
        self._inflight.trajectory_done(g, index, trajectory, t=self._last_t)
        if self._inflight_room() > 0:  # under ``group`` a trajectory frees nothing
            self._admit()
        return True

    def group_finished(
        self, group_id: int, trajectories: Optional[list[Trajectory]] = None, *, aborted: bool = False
    ) -> bool:
        """A whole group came back. ``trajectories=None``: use the ones reported one by one."""
        if group_id not in self._inflight.groups:
            self.counters["unknown_reports"] += 1
            return False
        self._advance()
        self._finish(group_id, trajectories, aborted)
        self.counters["finished"] += 1
        self._try_handoff()
        self._admit()
        return True

    def groups_finished(self, reports: list[tuple[int, Optional[list[Trajectory]], bool]]) -> list[bool]:
        """Several ``group_finished(group_id, trajectories, aborted=aborted)`` at once, in order (the same
        outcome as one call each; the hand-off and admission checks run once, after all of them)."""
        self._advance()
        known = []
        for gid, trajectories, aborted in reports:
            if gid in self._inflight.groups:
                self._finish(gid, trajectories, aborted)
                known.append(True)
            else:
                known.append(False)
        n = sum(known)
        self.counters["finished"] += n
        if n < len(known):
            self.counters["unknown_reports"] += len(known) - n
        if n:
            self._try_handoff()
            self._admit()
        return known

    def _finish(self, group_id: int, trajectories: Optional[list[Trajectory]], aborted: bool) -> None:
        g = self._inflight.pop(group_id, t=self._last_t)
        group, problem = assemble(g, trajectories, aborted, group_size=self.s.group_size, version=self.version)
        if problem is not None:
            self.counters[problem] += 1
        trajectories = group.trajectories
        self._last_arrival_t = self._last_t
        self._meter.counts["arrived"] += 1
        if self.autotuner is not None:  # generated tokens of the step, when the engines report nothing
            self._meter.arrived_tokens += sum(int(np.count_nonzero(t.loss_mask)) for t in trajectories if t is not None)
        rej = self.buffer.put(group)
        if rej is not None:
            self._reject(rej)
        self._take_evicted()

    # ----------------------------------------------------------------- the actor
    def request_batch(self, step: int, *, actor_version: Optional[int] = None) -> None:
        """The actor is ready for step ``step``; the batch appears in ``take_batch`` when complete."""
        if self.failure is not None:
            raise self.failure
        self._advance()
        v = self.version if actor_version is None else int(actor_version)
        if v < self.version:
            raise ValueError(f"request_batch: actor version {v} is behind the engines' version {self.version}")
        if self._request is None:
            prev = self._withdrawn if self._withdrawn is not None and self._withdrawn.step == step else None
            self._request = BatchRequest(step=step, actor_version=v, t=self._last_t if prev is None else prev.t)
            if prev is None:  # a re-request (the actor waits in slices) keeps the wait time and the warning clock
                self._last_warning_t = self._last_t
        self._try_handoff()
        self._admit()

    def cancel_request(self) -> None:
        self._advance()
        self._withdrawn, self._request = self._request, None

    def batch_filtered(self, group_ids: Sequence[int]) -> None:
        """The trainer's batch-level sample filter (``rollout_buffer.sample_filter_path``) removed
        these groups of the last batch: they count as dropped (``sample_filtered``), not trained, so
        ``issued == trained + dropped + held + reissued`` stays true. Not retried, and not counted
        against ``max_dropped_groups_per_step`` (the user's filter chose them)."""
        ids = [int(g) for g in group_ids]
        removed = set(ids)
        if len(removed) != len(ids):
            raise ValueError(f"batch_filtered: repeated group ids {sorted(ids)}")
        unknown = sorted(removed.difference(self._last_batch_ids))
        if unknown:
            raise ValueError(f"batch_filtered: groups {unknown} are not in the last batch handed out")
        self._last_batch_ids = [g for g in self._last_batch_ids if g not in removed]
        n = len(ids)
        self.counters["trained"] -= n
        self.counters["dropped"] += n
        self.counters["sample_filtered"] += n

    def sync_begin(self, mode: str = "retract") -> None:
        """A weight sync starts; ``drain`` stops issuing (workers hold new turns) until ``sync_end``."""
        self._advance()
        if mode == "drain":
            self._paused = True

    def sync_end(self, version: int) -> None:
        self._advance()
        if version < self.version:
            raise ValueError(f"sync_end: new version {version} is older than the current {self.version}")
        self.version = int(version)
        self._paused = False
        self._admit()

    def hold_issuing(self) -> None:
        """Stop issuing new prompts (in-flight groups finish and are buffered; turns are not held)."""
        self._advance()
        self._issuing_held = True

    def release_issuing(self) -> None:
        """Issue again (admission is re-checked at once)."""
        self._advance()
        self._issuing_held = False
        self._admit()

    def engine_figures(self, *, running_reqs: float, queue_reqs: float, gen_tokens_per_s: float) -> None:
        """The engines' latest ``/metrics`` (summed over engines): held until the next report and
        integrated over the step for the in-flight autotuner."""
        self._advance()
        self._engines = (float(running_reqs), float(queue_reqs), float(gen_tokens_per_s))

    # ----------------------------------------------------------------- periodic
    def tick(self) -> list[str]:
        """Periodic: expire silent workers, warn when the actor waits and nothing arrives."""
        self._advance()
        now = self._last_t
        for wid in self._pool.silent(now, self.s.worker_heartbeat_timeout_s):
            log.warning(
                "worker %s missed heartbeats for %.1fs (rollout_buffer.worker_heartbeat_timeout_s = %.1f)",
                wid,
                now - self._pool.workers[wid].last_seen,
                self.s.worker_heartbeat_timeout_s,
            )
            self.remove_worker(wid)
        out = []
        if self._request is not None and self.failure is None:
            since = now - max(self._last_arrival_t, self._last_warning_t)
            if since >= self.s.no_data_warning_s:
                msg = (
                    f"No completed rollout groups for {self.s.no_data_warning_s:.1f}s (actor waiting for step "
                    f"{self._request.step}: {len(self.buffer)}/{self.s.rollout_batch_size} groups buffered, "
                    f"{len(self._inflight)} in flight, {len(self._pool)} workers)"
                )
                log.warning(msg)
                out.append(msg)
                self._last_warning_t = now
                self.counters["no_data_warnings"] += 1
        if self._pool.joining:
            self._admit()  # the start-up grace may have ended with no other event
        return out

    # ----------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """Dataloader position, version, queued prompts, in-flight prompts (re-issued on resume), the
        buffered groups (``Group`` objects; the protocol encodes them) and the lifetime counters."""
        return {
            "counters": {k: int(v) for k, v in self.counters.items()},
            "version": self.version,
            "next_group_id": self._next_group_id,
            "dataloader": self.dataloader.state_dict(),
            "queued": [(it, e) for it, e in self._retry],
            "inflight": [(g.item, g.epoch) for g in sorted(self._inflight.groups.values(), key=lambda g: g.group_id)],
            "buffered": self.buffer.groups(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore after ``validate_state`` (a bad state, dataloader part included, raises ``ValueError`` naming the field
        and changes nothing); groups now in flight are cancelled (see ``take_cancelled``), the checkpoint's in-flight
        prompts are issued first and count as re-issued, so ``issued == trained + dropped + held + reissued``
        holds across the resume. A state without counters (older checkpoints) starts them from its groups."""
        validate_state(state, group_size=self.s.group_size)
        self.dataloader.check_state(state["dataloader"])
        counters = state.get("counters")
        if counters is None:
            counters = {"issued": len(state["inflight"]) + len(state["buffered"])}
        self._advance()
        self._cancelled += self._inflight.cancel_all()
        self.version = int(state["version"])
        self._next_group_id = max(self._next_group_id, int(state["next_group_id"]))
        self.dataloader.load_state_dict(state["dataloader"])
        self._retry = deque(list(state["inflight"]) + list(state["queued"]))
        self.buffer.restore(list(state["buffered"]))
        self.counters = Counter({k: int(v) for k, v in counters.items()})
        self.counters["reissued"] += len(state["inflight"])
        self._take_evicted()  # after the counters: a group the buffer gives up on restore counts as dropped
        self._batch = None
        self._admit()

    # ----------------------------------------------------------------- internals: admission, drops
    def _inflight_ok(self) -> bool:
        return self._inflight_room() > 0

    def _inflight_room(self) -> int:
        """Groups the in-flight limit admits now: ``group`` counts groups (RLinf), ``sample`` trajectories (Miles:
        each issue needs ``group_size`` free slots of the trajectory budget, whichever groups freed them)."""
        s = self.s
        if s.submission_granularity == "sample":
            return (self._sample_budget() - self._inflight.samples) // s.group_size
        return self.inflight_limit - len(self._inflight)

    def _sample_budget(self) -> int:
        """Trajectories ``sample`` allows in flight: ``max_inflight_samples``, else (or when autotuned) the in-flight
        limit in group-sized slots."""
        s = self.s
        if s.max_inflight_samples and self.autotuner is None:
            return s.max_inflight_samples
        return self.inflight_limit * s.group_size

    def _inflight_used(self) -> float:
        """In flight as the in-flight limit counts it, in groups: groups, or under ``sample`` trajectories / group_size."""
        if self.s.submission_granularity == "sample":
            return self._inflight.samples / self.s.group_size
        return float(len(self._inflight))

    def _buffer_ok(self) -> bool:
        return len(self._inflight) + len(self.buffer) < self.s.max_buffered_groups

    def _issue_allowance(self) -> float:
        """How many groups may be issued regardless of the limits (pause, sync mode, no workers)."""
        if self.failure is not None or self._paused or self._issuing_held or not self._pool.workers:
            return 0
        if self.s.sync_mode:
            if self._request is None:
                return 0
            return max(0, self.s.rollout_batch_size - len(self._inflight) - len(self.buffer))
        return math.inf

    def _advance(self) -> None:
        """Integrate the admission-wait time since the previous event (state was constant meanwhile)."""
        now = self.clock()
        dt = now - self._last_t
        if dt <= 0:
            return
        meter = self._meter
        if self._issue_allowance() > 0:  # exclusive: buffer full wins (room in flight would admit nothing)
            if not self._buffer_ok():
                meter.wait_buffer += dt
            elif not self._inflight_ok():
                meter.wait_inflight += dt
        meter.advance(dt, self._inflight_used(), self._engines)
        self._last_t = now

    def _admit(self) -> None:
        allowance = self._issue_allowance()
        if allowance <= 0:
            return
        s, gs = self.s, self.s.group_size
        n_inflight = len(self._inflight)
        n = min(self._inflight_room(), s.max_buffered_groups - n_inflight - len(self.buffer))
        if n <= 0:
            return
        if allowance < n:
            n = int(allowance)
        pool = self._pool
        capped = pool.joining and pool.still_joining(self._last_t)
        retry, nxt = self._retry, self.dataloader.next
        add, issues, version = self._inflight.add, self._issues, self.version
        gid = start = self._next_group_id
        for _ in range(n):
            wid, w = pool.least_loaded()
            if capped and w.outstanding >= w.capacity:  # the least loaded is full: every worker is
                break
            item, epoch = retry.popleft() if retry else nxt()
            add(gid, item, epoch, wid, w, version, gs)
            issues.append(Issue(wid, gid, item, epoch, gs, version))
            gid += 1
        self._next_group_id = gid
        n = gid - start
        self.counters["issued"] += n
        self._meter.counts["issued"] += n

    def _take_evicted(self) -> None:
        """Groups the buffer gave up on its own (a Miles buffer's ``on_evict``): dropped or retried like unused ones."""
        for r in self.buffer.take_evicted():
            self._reject(r)

    def _reject(self, rej: Rejection) -> None:
        g = rej.group
        retried = rej.handler == "unused" and self.s.unused_groups == "retry"
        if retried:
            self._retry.append((g.item, g.epoch))
        self._drops.append(Drop(g.group_id, g.item, g.epoch, rej.reason, retried))
        self.counters["dropped"] += 1
        self.counters["retried"] += int(retried)
        step = self._meter.counts
        step["dropped"] += 1
        step["retried"] += int(retried)
        step["drop_" + rej.reason] += 1
        if step["dropped"] > self.s.max_dropped_groups_per_step and self.failure is None:
            reasons = {k[5:]: v for k, v in step.items() if k.startswith("drop_")}
            self.failure = TooManyDropsError(too_many_drops_message(self.s, step["dropped"], reasons))
            log.error(str(self.failure))

    # ----------------------------------------------------------------- internals: the hand-off
    def _try_handoff(self) -> None:
        req = self._request
        if req is None or self.failure is not None or self._batch is not None:
            return
        if self.s.max_staleness is None and len(self.buffer) < self.s.rollout_batch_size:
            return
        # Miles' staleness (get-time filter, rollout/fully_async/*) is against the engines' current version;
        # RLinf's rollout/data_staleness/* (_step_metrics) against the actor's
        groups, rejected = self.buffer.get(self.s.rollout_batch_size, engine_version=self.version)
        for r in rejected:
            self._reject(r)
        self._take_evicted()
        if groups is None or self.failure is not None:
            if groups is not None:  # the limit tripped in this very call: keep the groups out of training
                self.buffer.restore(groups + self.buffer.groups())
            return
        now = self._last_t
        self._batch = Batch(
            step=req.step,
            groups=groups,
            wait_s=now - req.t,
            metrics=self._step_metrics(groups, req.actor_version, now - req.t),
        )
        self.last_metrics = self._batch.metrics
        self.counters["trained"] += len(groups)
        self._last_batch_ids = [g.group_id for g in groups]
        self._request = None
        self._meter.reset(now)

    def _step_metrics(self, groups: list[Group], v: int, wait_s: float) -> dict[str, float]:
        dur = self._last_t - self._meter.start_t
        m = self._meter.admission_metrics(dur) | self._meter.staleness_metrics(groups, actor_version=v)
        m |= {
            "rollout/buffer/num_inflight_groups": float(len(self._inflight)),
            "rollout/buffer/num_inflight_samples": float(self._inflight.samples),
            "rollout/buffer/num_buffered_groups": float(len(self.buffer)),
            "rollout/buffer/num_workers": float(len(self._pool)),
            "rollout/epoch": float(max(g.epoch for g in groups)),
            "rollout/weight_version": float(v),
            "data/skipped_long_prompts": float(self.num_skipped_long_prompts),
            "time/wait_data": wait_s,
        }
        m.update(self.buffer.get_metrics())
        m.update(self._autotune(dur, wait_s, len(groups)))
        return m

    def _autotune(self, dur: float, wait_s: float, n_groups: int) -> dict[str, float]:
        """The step's figures for the in-flight autotuner (when on); the limit in force next; the side that set the
        step's pace (``autotune.binding_side``: did the actor wait for its batch?)."""
        side = binding_side(wait_s, dur)
        m = {
            "rollout/buffer/inflight_limit": float(self.inflight_limit),
            "rollout/buffer/mean_inflight_groups": self._meter.area[0] / dur if dur > 0 else self._inflight_used(),
        }
        if side is not None:
            m["rollout/buffer/training_bound"] = float(side == TRAINING)
        if self.autotuner is None or dur <= 0:
            return m
        if side != self._side and side is not None:
            log.info(
                "rollout_buffer.max_inflight_groups (auto): %s sets the pace (the actor waited %.2f s of a %.1f s step "
                "for its batch) at a limit of %d",
                side,
                wait_s,
                dur,
                self.inflight_limit,
            )
            self._side = side
        figures = self._meter.figures(
            limit=self.inflight_limit,
            dur=dur,
            wait_data_s=wait_s,
            trained_groups=n_groups,
            surplus_groups=len(self.buffer),
        )
        change = self.autotuner.observe(figures)
        if change is not None:
            log.info("rollout_buffer.max_inflight_groups (auto): %d -> %d: %s", change.old, change.new, change.reason)
            self.inflight_limit = change.new
            m["rollout/buffer/inflight_limit_change"] = float(change.new - change.old)
        return m


_ACCOUNTED = ("issued", "trained", "dropped", "reissued")


def validate_state(state: dict, *, group_size: int) -> None:
    """Check a broker state before anything is restored: ``ValueError`` naming the field when the version,
    the group ids, the buffered groups or the counters are out of range, or when the counters break
    ``issued == trained + dropped + held + reissued`` (held = the state's in-flight + buffered groups)."""
    for key in ("version", "next_group_id"):
        v = state.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"broker state: {key} must be an integer >= 0, got {v!r}")
    buffered = state["buffered"]
    ids = [g.group_id for g in buffered]
    if len(set(ids)) != len(ids):
        raise ValueError("broker state: buffered group ids are not unique")
    for g in buffered:
        if not 0 <= g.group_id < state["next_group_id"]:
            raise ValueError(
                f"broker state: buffered group {g.group_id} is not below next_group_id {state['next_group_id']}"
            )
        if len(g.trajectories) != group_size:
            raise ValueError(
                f"broker state: buffered group {g.group_id} has {len(g.trajectories)} trajectories, "
                f"expected rollout.n_samples_per_prompt = {group_size}"
            )
    counters = state.get("counters")
    if counters is None:
        return
    if not isinstance(counters, dict):
        raise ValueError(f"broker state: counters must be a map, got {type(counters).__name__}")
    for k, v in counters.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"broker state: counters.{k} must be an integer >= 0, got {v!r}")
    issued, trained, dropped, reissued = (counters.get(k, 0) for k in _ACCOUNTED)
    held = len(state["inflight"]) + len(buffered)
    if issued != trained + dropped + held + reissued:
        raise ValueError(
            f"broker state: counters break issued == trained + dropped + held + reissued "
            f"({issued} != {trained} + {dropped} + {held} + {reissued})"
        )


def _default_buffer(s: CoreSettings) -> DataBuffer:
    """The buffer the settings name: the default one (with the dynamic-sampling filter), or the user's class."""
    flt = None
    if s.dynamic_sampling_filter_path:
        flt = import_path(s.dynamic_sampling_filter_path, "rollout_buffer.dynamic_sampling_filter_path")
    bs = BufferSettings(
        max_staleness=s.max_staleness,
        dynamic_filter=flt,
        capacity=s.max_buffered_groups,
        rollout_batch_size=s.rollout_batch_size,
        group_size=s.group_size,
        unused_groups=s.unused_groups,
    )
    return make_data_buffer(bs, s.custom_data_buffer_path) if s.custom_data_buffer_path else DefaultDataBuffer(bs)
