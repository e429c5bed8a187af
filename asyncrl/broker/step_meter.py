"""The broker core's figures of one step (between two hand-offs): counts, admission waits, staleness.

Part of ``BrokerCore`` (``core.py``), pure: the core integrates time from its injected clock into
``advance`` (state is constant between two events) and reads the step's metrics at the hand-off.
The two admission waits are exclusive (the core counts a blocked second once: buffer full, else the
in-flight limit), so they add up to the share of the step admission was blocked, at most 1.
RLinf's staleness (``rollout/data_staleness/*``) = actor version at the start of the step -
group.min_version; it splits exactly into version_span = finished_version - min_version and
queue_steps = actor version - finished_version.

    meter = StepMeter(now=0.0)
    meter.advance(1.5, 8.0, None); meter.wait_inflight += 1.5   # 8 groups in flight for 1.5 s, limit bound
    meter.counts["issued"] += 8
    meter.staleness_metrics(groups, actor_version=3)   # {'rollout/data_staleness/mean': ..., ...}
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from asyncrl.broker.autotune import StepFigures
from asyncrl.broker.types import Group


class StepMeter:
    def __init__(self, *, now: float):
        self.reset(now)

    def reset(self, now: float) -> None:
        self.start_t = now
        self.counts: Counter[str] = Counter()
        """Issued, arrived, dropped, retried, reissued, drop_<reason> since the last hand-off."""
        self.wait_inflight = 0.0
        """Seconds admission was held back by the in-flight limit alone (the buffer had room)."""
        self.wait_buffer = 0.0
        """Seconds admission was held back by a full buffer (whatever the in-flight limit): the two are exclusive."""
        self.area = [0.0, 0.0, 0.0, 0.0]
        """Time integrals: in-flight groups, engines' running and queued requests, engines' tokens/s."""
        self.arrived_tokens = 0
        """Generated tokens of the groups that arrived (the throughput when the engines report nothing)."""

    def advance(self, dt: float, inflight: float, engines: Optional[tuple[float, float, float]]) -> None:
        """``dt`` seconds passed in a constant state: integrate the areas (the core adds the admission waits)."""
        a = self.area
        a[0] += inflight * dt
        if engines is not None:
            a[1] += engines[0] * dt
            a[2] += engines[1] * dt
            a[3] += engines[2] * dt

    def admission_metrics(self, dur: float) -> dict[str, float]:
        return {
            "rollout/buffer/admission_wait_inflight_limit": self.wait_inflight / dur if dur > 0 else 0.0,
            "rollout/buffer/admission_wait_buffer_full": self.wait_buffer / dur if dur > 0 else 0.0,
            "rollout/buffer/issued_groups": float(self.counts["issued"]),
            "rollout/buffer/dropped_groups": float(self.counts["dropped"]),
            "rollout/buffer/retried_groups": float(self.counts["retried"]),
            "rollout/buffer/reissued_groups": float(self.counts["reissued"]),
            "rollout/buffer/step_duration_s": dur,
        }

    def figures(
        self, *, limit: int, dur: float, wait_data_s: float, trained_groups: int, surplus_groups: int
    ) -> StepFigures:
        """The step's figures for the in-flight autotuner (``dur > 0``): the engines' own when they reported, and
        the broker's own (the actor's wait for this batch, groups arrived and trained) that tell which side binds."""
        a = self.area
        eng = a[3] > 0
        return StepFigures(
            limit=limit,
            mean_inflight=a[0] / dur,
            tokens_per_s=(a[3] if eng else self.arrived_tokens) / dur,
            wait_inflight=self.wait_inflight / dur,
            wait_buffer=self.wait_buffer / dur,
            running_reqs=a[1] / dur if eng else None,
            queue_reqs=a[2] / dur if eng else None,
            wait_data_s=wait_data_s,
            step_s=dur,
            arrived_groups=float(self.counts["arrived"]),
            trained_groups=trained_groups,
            surplus_groups=float(surplus_groups),
        )

    @staticmethod
    def staleness_metrics(groups: list[Group], *, actor_version: int) -> dict[str, float]:
        """RLinf's staleness of a batch and its split (version span + queue steps), and the ratio per value."""
        v = actor_version
        mins = [
            min([t.min_version for t in g.trajectories]) if g.trajectories else g.issued_version for g in groups
        ]  # Group.min_version, computed once per group
        st = [v - m for m in mins]
        n = len(groups)
        m = {
            "rollout/data_staleness/mean": sum(st) / n,
            "rollout/data_staleness/max": float(max(st)),
            "rollout/version_span/mean": sum(g.finished_version - mv for g, mv in zip(groups, mins)) / n,
            "rollout/queue_steps/mean": sum(v - g.finished_version for g in groups) / n,
        }
        for k, c in sorted(Counter(st).items()):
            m[f"rollout/data_staleness/ratio_{k}"] = c / n
        return m
