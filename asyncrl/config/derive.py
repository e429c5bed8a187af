"""Derived defaults, computed exactly as the seeds state them. Pure.

- ``rollout_buffer.max_inflight_groups = ceil(max_running_requests x instances x 1.2 / group_size)``
  (RLinf), or ``max_concurrent_samples // group_size`` when that Miles setting is given; ``"auto"``
  stays ``"auto"`` (the broker tunes it, starting at ``inflight_start``);
- ``rollout_buffer.max_buffered_groups = floor(async_data_buffer_capacity_factor x data.rollout_batch_size)``,
  the factor 2.0 when unset (Miles' default), i.e. ``2 x data.rollout_batch_size``;
- ``rollout_buffer.max_dropped_groups_per_step = 10 x data.rollout_batch_size``;
- ``rollout_buffer.submission_granularity = "group"`` (RLinf's group counting), or ``"sample"`` (Miles' per-trajectory
  counting, Miles' fully-async default) when a Miles user sets ``max_concurrent_samples`` in async mode;
- ``rollout.model_path = actor.model_path``;
- ``agentloop.max_requests_per_engine = rollout.max_running_requests``.
"""

from __future__ import annotations

import math
from dataclasses import replace

from asyncrl.config.placement import parse_devices
from asyncrl.config.schema import Config, ConfigError

INFLIGHT_MARGIN = 1.2  # RLinf: margin for groups waiting on a tool or on their slowest member
CAPACITY_FACTOR = 2.0  # Miles' --async-data-buffer-capacity-factor default


def num_engines(cfg: Config) -> int:
    """Rollout instances: rollout devices / devices per engine (0 when the placement is unparsable)."""
    for key, spec in cfg.cluster.component_placement.items():
        if "rollout" in [n.strip() for n in key.split(",")]:
            try:
                n = len(parse_devices(spec, f"cluster.component_placement.{key}"))
            except ConfigError:
                return 0
            return max(1, n // cfg.rollout.tensor_parallel_size)
    return 0


def default_max_inflight_groups(*, max_running_requests: int, instances: int, group_size: int) -> int:
    return max(1, math.ceil(max_running_requests * instances * INFLIGHT_MARGIN / group_size))


def derived_max_inflight_groups(cfg: Config) -> int:
    """``rollout_buffer.max_inflight_groups``' derived value, the one rule for both the unset setting
    (``resolve``) and ``"auto"``'s start (``inflight_start``): ``max_concurrent_samples // group_size`` when
    that Miles setting is given, else ``default_max_inflight_groups`` over the rollout instances."""
    rb, gs = cfg.rollout_buffer, cfg.algorithm.group_size
    if rb.max_concurrent_samples is not None:
        return max(1, rb.max_concurrent_samples // gs)
    return default_max_inflight_groups(
        max_running_requests=cfg.rollout.max_running_requests, instances=max(1, num_engines(cfg)), group_size=gs
    )


def inflight_start(cfg: Config) -> int:
    """The in-flight limit the broker starts with: the configured number, or for ``"auto"`` the derived
    default capped at the buffer limit's bound ``max_buffered_groups - rollout_batch_size`` (of a resolved
    config)."""
    rb = cfg.rollout_buffer
    if rb.max_inflight_groups != "auto":
        return rb.max_inflight_groups
    return max(1, min(derived_max_inflight_groups(cfg), rb.max_buffered_groups - cfg.data.rollout_batch_size))


def resolve(cfg: Config) -> Config:
    derived = set(cfg.derived)
    rb = cfg.rollout_buffer
    B = cfg.data.rollout_batch_size
    updates = {}
    if rb.max_inflight_groups is None:
        updates["max_inflight_groups"] = derived_max_inflight_groups(cfg)
    if rb.max_buffered_groups is None:
        factor = (
            CAPACITY_FACTOR if rb.async_data_buffer_capacity_factor is None else rb.async_data_buffer_capacity_factor
        )
        updates["max_buffered_groups"] = max(1, math.floor(factor * B))
    if rb.max_dropped_groups_per_step is None:
        updates["max_dropped_groups_per_step"] = 10 * B
    if rb.submission_granularity is None:
        miles = cfg.runner.async_mode and rb.max_concurrent_samples is not None
        updates["submission_granularity"] = "sample" if miles else "group"
    derived |= {f"rollout_buffer.{k}" for k in updates}
    out = replace(cfg, rollout_buffer=replace(rb, **updates))
    if out.rollout.model_path is None:
        out = replace(out, rollout=replace(out.rollout, model_path=out.actor.model_path))
        derived.add("rollout.model_path")
    if out.agentloop.max_requests_per_engine is None:
        out = replace(out, agentloop=replace(out.agentloop, max_requests_per_engine=out.rollout.max_running_requests))
        derived.add("agentloop.max_requests_per_engine")
    return replace(out, derived=frozenset(derived))


def explain(cfg: Config) -> list[str]:
    """What the Miles-style settings map onto, for the dry run (one line each)."""
    rb, B = cfg.rollout_buffer, cfg.data.rollout_batch_size
    lines = []
    if "rollout_buffer.max_buffered_groups" in cfg.derived:
        f = rb.async_data_buffer_capacity_factor
        f = CAPACITY_FACTOR if f is None else f
        lines.append(
            f"rollout_buffer.async_data_buffer_capacity_factor = {f:g} -> rollout_buffer.max_buffered_groups "
            f"= floor({f:g} x rollout_batch_size {B}) = {rb.max_buffered_groups} (in-flight + buffered groups)"
        )
    lines.append(_counting_line(cfg))
    return lines


def _counting_line(cfg: Config) -> str:
    """Which counting the in-flight limit uses, and its bound."""
    rb, gs = cfg.rollout_buffer, cfg.algorithm.group_size
    if "rollout_buffer.submission_granularity" not in cfg.derived:
        how = "set"
    elif rb.submission_granularity == "sample":
        how = "derived: max_concurrent_samples is set in async mode, Miles' default"
    else:
        how = "derived: RLinf's default"
    n = rb.max_inflight_groups
    if n == "auto":  # a number is spelled out only where there is one: the broker's start
        start = inflight_start(cfg)
        limit = f"max_inflight_groups = auto (tuned by the broker, starting at {start})"
    else:
        start, limit = n, f"max_inflight_groups = {n}"
    if rb.submission_granularity == "sample":
        if rb.max_concurrent_samples and n != "auto":
            budget = f"rollout_buffer.max_concurrent_samples = {rb.max_concurrent_samples} trajectories"
        else:
            budget = f"{limit} x group_size trajectories, starting at {start} x {gs} = {start * gs}"
            if n != "auto":
                budget = f"{limit} x group_size = {start * gs} trajectories"
        return (
            f'rollout_buffer.submission_granularity = "sample" ({how}): the in-flight limit counts trajectories '
            f"(Miles): at most {budget} in flight; each finished trajectory frees its own slot and a new group goes "
            f"out once {gs} (group_size) have finished; groups in flight are bounded by max_buffered_groups alone"
        )
    return (
        f'rollout_buffer.submission_granularity = "group" ({how}): the in-flight limit counts groups (RLinf): at '
        f"most {limit} groups in flight, each holding its slot until its last "
        f"trajectory returns"
    )
