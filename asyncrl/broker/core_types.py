"""The broker core's settings, what it hands the shell (issues, batches, drops) and its errors.

``BrokerCore`` (``core.py``) takes a ``CoreSettings``; the ZeroMQ server, the simulator and the tests
build one with ``CoreSettings.from_config(cfg)`` or by hand. ``from_config`` takes a resolved config and
copies its values: every derived default (``submission_granularity``, the limits, the in-flight start) is
computed in ``asyncrl.config.derive`` alone, never here. ``Issue``, ``Batch`` and ``Drop`` are what
``take_issues`` / ``take_batch`` / ``take_drops`` return.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from asyncrl.broker.types import Group, PromptItem
from asyncrl.config.derive import inflight_start, num_engines

_DERIVED = ("max_inflight_groups", "max_buffered_groups", "max_dropped_groups_per_step", "submission_granularity")
"""The rollout_buffer fields ``asyncrl.config.derive.resolve`` fills in: None means the config was not resolved."""


class BrokerError(RuntimeError):
    """A failure of the broker that stops the run (reported to the actor)."""


class TooManyDropsError(BrokerError):
    pass


@dataclass(frozen=True)
class CoreSettings:
    rollout_batch_size: int
    group_size: int
    max_inflight_groups: int
    max_buffered_groups: int
    max_dropped_groups_per_step: int
    submission_granularity: Literal["group", "sample"] = "group"
    max_inflight_samples: Optional[int] = None
    """Trajectory budget under ``sample`` (``rollout_buffer.max_concurrent_samples``); None: max_inflight_groups x
    group_size. Unused under ``group``, whose limit is max_inflight_groups (derived from it when it is set)."""
    unused_groups: Literal["drop", "retry"] = "drop"
    max_staleness: Optional[int] = None
    sync_mode: bool = False
    seed: int = 0
    shuffle: bool = True
    no_data_warning_s: float = 30.0
    worker_heartbeat_timeout_s: float = 15.0
    dynamic_sampling_filter_path: Optional[str] = None
    custom_data_buffer_path: Optional[str] = None
    inflight_autotune: bool = False
    expected_workers: int = 0
    """Workers the run starts (one per engine); until they joined, none is issued past its capacity. 0: unknown."""
    worker_join_grace_s: float = 60.0
    """How long after the first join admission waits for ``expected_workers`` before it loads who is there."""

    @classmethod
    def from_config(cls, cfg) -> CoreSettings:
        """From a resolved ``asyncrl.config.Config`` (``load_config`` resolves; its derived values are taken as they are)."""
        rb = cfg.rollout_buffer
        unresolved = [k for k in _DERIVED if getattr(rb, k) is None]
        if unresolved:
            raise ValueError(f"CoreSettings.from_config: rollout_buffer.{unresolved} unset: resolve the config first")
        return cls(
            rollout_batch_size=cfg.data.rollout_batch_size,
            group_size=cfg.algorithm.group_size,
            max_inflight_groups=inflight_start(cfg),
            max_buffered_groups=rb.max_buffered_groups,
            inflight_autotune=rb.max_inflight_groups == "auto",
            max_dropped_groups_per_step=rb.max_dropped_groups_per_step,
            submission_granularity=rb.submission_granularity,
            max_inflight_samples=rb.max_concurrent_samples,
            unused_groups=rb.unused_groups,
            max_staleness=cfg.agentloop.max_actor_accept_staleness,
            sync_mode=not cfg.runner.async_mode,
            seed=cfg.runner.seed,
            shuffle=cfg.data.shuffle,
            no_data_warning_s=rb.no_data_warning_s,
            worker_heartbeat_timeout_s=rb.worker_heartbeat_timeout_s,
            dynamic_sampling_filter_path=rb.dynamic_sampling_filter_path,
            custom_data_buffer_path=rb.custom_data_buffer_path,
            expected_workers=num_engines(cfg),
        )


@dataclass(slots=True)
class Issue:
    """A group to send to a worker."""

    worker_id: str
    group_id: int
    item: PromptItem
    epoch: int
    group_size: int
    version: int


@dataclass
class Batch:
    """What the actor gets for one step."""

    step: int
    groups: list[Group]
    wait_s: float
    metrics: dict[str, float]


@dataclass
class Drop:
    group_id: int
    item: PromptItem
    epoch: int
    reason: str
    retried: bool


def too_many_drops_message(s: CoreSettings, dropped: int, reasons: dict[str, int]) -> str:
    """The error of ``rollout_buffer.max_dropped_groups_per_step``: what was dropped, why, and the fixes."""
    fixes = []
    if reasons.get("stale"):
        fixes.append(
            f"raise agentloop.max_actor_accept_staleness (now {s.max_staleness}) above "
            f"max_buffered_groups / rollout_batch_size = "
            f"{s.max_buffered_groups / s.rollout_batch_size:g}, or lower "
            f"rollout_buffer.max_buffered_groups"
        )
    if reasons.get("aborted"):
        fixes.append("fix what aborts the groups (engine or retriever failures: see the agent worker logs)")
    others = [r for r in reasons if r not in ("stale", "aborted")]
    if others:
        fixes.append(
            f"loosen the dynamic-sampling filter (rollout_buffer.dynamic_sampling_filter_path) rejecting for {others}"
        )
    return (
        f"rollout_buffer.max_dropped_groups_per_step: {dropped} groups were dropped since the "
        f"last batch (limit {s.max_dropped_groups_per_step}; by reason {reasons}): groups are dropped "
        f"faster than training uses them. To fix: {'; '.join(fixes)}; or raise "
        f"rollout_buffer.max_dropped_groups_per_step."
    )
