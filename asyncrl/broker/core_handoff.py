"""The actor's side of the broker core: batch requests, the hand-off of the oldest groups, the step's metrics.

A part of ``BrokerCore`` (``core.py``; a mixin: the core owns the state, this holds the methods that
serve the actor). Pure like the rest of the core. The hand-off gives the oldest ``rollout_batch_size``
buffered groups (arrival order) after the get-time staleness filter (Miles': engines' current version -
group.min_version); the batch's metrics are computed then, and the in-flight autotuner (when on) takes
the step's figures and may move the in-flight limit for the next step.

    core.request_batch(step=3, actor_version=3)   # the batch appears in take_batch() once complete
    core.cancel_request()                          # the actor gave up waiting (asking again continues it)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from asyncrl.broker.core_types import Batch
from asyncrl.broker.types import Group

log = logging.getLogger("asyncrl.broker")


@dataclass
class BatchRequest:
    step: int
    actor_version: int
    t: float


class ActorSide:
    """``request_batch``, ``cancel_request``, ``batch_filtered`` and the hand-off; state is ``BrokerCore``'s."""

    _request: Optional[BatchRequest]
    _withdrawn: Optional[BatchRequest]
    _batch: Optional[Batch]

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
        m.update(self._autotune(dur))
        return m

    def _autotune(self, dur: float) -> dict[str, float]:
        """The step's figures for the in-flight autotuner (when on); the limit in force next."""
        m = {
            "rollout/buffer/inflight_limit": float(self.inflight_limit),
            "rollout/buffer/mean_inflight_groups": self._meter.area[0] / dur if dur > 0 else self._inflight_used(),
        }
        if self.autotuner is None or dur <= 0:
            return m
        change = self.autotuner.observe(self._meter.figures(limit=self.inflight_limit, dur=dur))
        if change is not None:
            log.info("rollout_buffer.max_inflight_groups (auto): %d -> %d: %s", change.old, change.new, change.reason)
            self.inflight_limit = change.new
            m["rollout/buffer/inflight_limit_change"] = float(change.new - change.old)
        return m
