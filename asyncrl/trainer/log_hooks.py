"""Miles' custom logging hooks (``logging.custom_rollout_log_function_path``,
``logging.custom_eval_rollout_log_function_path``). Pure: no I/O besides calling the user's function.

Contract (the signatures of Miles' page; ``args`` is the run's resolved ``Config``):
- ``log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool``: called once
  per training step on actor rank 0 with the step (``rollout_id``), the step's trained trajectories
  (``samples``, flat, group by group), its rollout metrics (every ``rollout/*`` key) and the time the step
  waited for its batch (``time/rollout`` in sync mode, ``time/wait_data`` in async mode).
- ``log_eval_rollout_data(rollout_id, args, data, extra_metrics) -> bool``: called for every eval record
  (periodic points of every backend, the before/after eval) with the eval step, ``data`` =
  ``{dataset: {metric: value}}`` (from ``eval/<dataset>/<metric>``) and every ``eval/*`` metric of the record.
- Returning ``True`` skips the default logging of what the hook got: the ``rollout/*`` (resp. ``eval/*``)
  keys are left out of that record (TensorBoard, metrics.jsonl); anything else keeps the default logging.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional


def _load(path: Optional[str], key: str) -> Optional[Callable[..., Any]]:
    if not path:
        return None
    from asyncrl.config.validate import resolve_hook as import_path

    fn = import_path(path, key)
    if not callable(fn):
        raise ValueError(f"{key}: {path!r} is not callable")
    return fn


def eval_data(metrics: dict[str, float]) -> dict[str, dict[str, float]]:
    """``eval/<dataset>/<metric>`` -> ``{dataset: {metric: value}}`` (top-level ``eval/x`` keys are left out)."""
    out: dict[str, dict[str, float]] = {}
    for k, v in metrics.items():
        parts = k.split("/", 2)
        if len(parts) == 3 and parts[0] == "eval":
            out.setdefault(parts[1], {})[parts[2]] = v
    return out


class LogHooks:
    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.rollout_fn = _load(
            cfg.logging.custom_rollout_log_function_path, "logging.custom_rollout_log_function_path"
        )
        self.eval_fn = _load(
            cfg.logging.custom_eval_rollout_log_function_path, "logging.custom_eval_rollout_log_function_path"
        )

    def step(self, step: int, groups: list, metrics: dict[str, float]) -> dict[str, float]:
        """The step's record as the default logging should write it (the rollout hook, then the eval hook)."""
        if self.rollout_fn is not None:
            samples = [t for g in groups or () for t in g.trajectories]
            extra = {k: v for k, v in metrics.items() if k.startswith("rollout/")}
            t = metrics.get("time/rollout", metrics.get("time/wait_data", 0.0))
            if self.rollout_fn(step, self.cfg, samples, extra, t) is True:
                metrics = {k: v for k, v in metrics.items() if not k.startswith("rollout/")}
        return self.eval(step, metrics)

    def eval(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """An eval record (or a step record with eval keys) as the default logging should write it."""
        extra = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        if self.eval_fn is None or not extra:
            return metrics
        if self.eval_fn(step, self.cfg, eval_data(extra), extra) is True:
            return {k: v for k, v in metrics.items() if not k.startswith("eval/")}
        return metrics
