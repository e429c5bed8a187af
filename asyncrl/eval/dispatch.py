"""The eval dispatcher: external and fleet eval points on one background thread, their outcomes and metrics.

Contract
- ``EvalDispatcher(evaluate, max_in_flight=, overflow_policy=, keep_snapshots=)`` runs
  ``evaluate(snapshot_dir, step) -> {name: value}`` on ONE background thread (evals are serialized);
  ``max_in_flight`` bounds the snapshots submitted and not yet finished. ``admit(step)`` before exporting a due
  point: with no free slot it waits (``backpressure``, at most ``wait_timeout_s``) or refuses (``skip``: counted).
  ``EvalSkip(reason)`` from ``evaluate`` is a skipped point; any other exception is logged with its traceback and
  counted in ``num_errors``; a snapshot without its completion marker (``snapshot_version`` is None) is skipped
  as ``ckpt_missing`` and never handed to ``evaluate``. Owned snapshots are deleted once more than
  ``keep_snapshots`` have been retired (oldest first); periodic checkpoints are never deleted.
- ``outcome_metrics(outcome, logged_at=, ...)``: what a finished point logs at its own step (see
  ``asyncrl.eval.backends`` for the names).

    disp = EvalDispatcher(fn, max_in_flight=2, overflow_policy="backpressure", keep_snapshots=2)
    if disp.admit(step): disp.submit(step, snapshot_dir, owned=True)
    for out in disp.poll(): writer.log(outcome_metrics(out, logged_at=step, num_skipped=0, num_errors=0), out.step)
"""

from __future__ import annotations

import json
import logging
import queue
import re
import shutil
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from asyncrl.actor.checkpoint import CheckpointManager

log = logging.getLogger("asyncrl.eval")

SNAPSHOT_META = "snapshot.json"
"""Written last into a fresh snapshot: ``{"step", "weight_version"}`` (its presence marks it complete)."""


class EvalSkip(Exception):
    """Raised by ``CheckpointEvalFn.evaluate_checkpoint``: this point is skipped, for ``reason``."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def skip_metric(reason: str) -> str:
    """``eval/skipped_<reason>`` with ``reason`` made a metric name (lower case, ``[a-z0-9_]``, 64 chars)."""
    slug = re.sub(r"[^a-z0-9]+", "_", reason.lower()).strip("_")[:64] or "unknown"
    return f"eval/skipped_{slug}"


def snapshot_version(snapshot: str | Path, step: int) -> Optional[int]:
    """The weight version a complete snapshot records (``step`` when a fresh export records none), or None without
    its completion marker: a fresh export's ``snapshot.json`` (written last), or for a reused ``hf_export`` its
    checkpoint's meta (``CheckpointManager.exported_version``)."""
    marker = Path(snapshot) / SNAPSHOT_META
    if not marker.is_file():
        return CheckpointManager.exported_version(snapshot)
    try:
        return int(json.loads(marker.read_text()).get("weight_version", step))
    except (ValueError, TypeError, OSError, AttributeError):
        return None


# ------------------------------------------------------------------------------------------- dispatcher
@dataclass
class EvalOutcome:
    step: int
    status: Literal["ok", "skipped", "error"]
    metrics: dict[str, float] = field(default_factory=dict)
    reason: str = ""
    duration_s: float = 0.0
    snapshot: Optional[str] = None
    weight_version: Optional[int] = None
    """The snapshot's recorded weight version (points that ran)."""


@dataclass
class _Point:
    step: int
    snapshot: Path
    owned: bool


class EvalDispatcher:
    """Runs ``evaluate(snapshot_dir, step) -> {name: value}`` on one background thread, one point at a time.

    ``admit(step)`` before exporting a due point (backpressure: wait for a slot; skip: False), then
    ``submit(step, snapshot, owned=...)``. ``poll()`` returns finished outcomes in step order without
    blocking; ``close(timeout_s)`` waits for the pending ones. Owned snapshots are deleted once more than
    ``keep_snapshots`` have been retired (oldest first). Thread-safe for one caller thread.
    """

    def __init__(
        self,
        evaluate: Callable[[str, int], dict],
        *,
        max_in_flight: int,
        overflow_policy: Literal["backpressure", "skip"],
        keep_snapshots: int,
        wait_timeout_s: float = 600.0,
    ):
        assert max_in_flight >= 1 and keep_snapshots >= 0
        self._evaluate = evaluate
        self.max_in_flight, self.overflow_policy = max_in_flight, overflow_policy
        self.keep_snapshots, self.wait_timeout_s = keep_snapshots, wait_timeout_s
        self.num_skipped = 0
        """Skipped points so far (overflow under ``skip`` and ``EvalSkip``)."""
        self.num_errors = 0
        """Points whose eval function raised."""
        self.num_completed = 0
        self._cv = threading.Condition()
        self._pending = 0
        self._done: deque[EvalOutcome] = deque()
        self._retired: deque[Path] = deque()
        self._queue: queue.Queue[Optional[_Point]] = queue.Queue()
        # daemon: an eval that hangs past close()'s timeout must not keep the finished run alive
        self._thread = threading.Thread(target=self._run, name="eval-dispatch", daemon=True)
        self._thread.start()

    @property
    def num_pending(self) -> int:
        with self._cv:
            return self._pending

    def admit(self, step: int) -> bool:
        """May a point for ``step`` be exported now? ``skip``: False when ``max_in_flight`` snapshots are still
        being evaluated (counted and logged); ``backpressure``: waits for the oldest to finish."""
        with self._cv:
            if self._pending < self.max_in_flight:
                return True
            if self.overflow_policy == "skip":
                self.num_skipped += 1
                log.warning(
                    "eval point of step %d skipped: %d evals still in flight (eval.eval_max_in_flight = %d, "
                    'eval.eval_overflow_policy = "skip")',
                    step,
                    self._pending,
                    self.max_in_flight,
                )
                return False
            if not self._cv.wait_for(lambda: self._pending < self.max_in_flight, timeout=self.wait_timeout_s):
                raise TimeoutError(
                    f"eval.eval_wait_timeout_s: no eval slot for step {step} within {self.wait_timeout_s:.0f}s "
                    f"({self._pending} evals in flight, eval.eval_max_in_flight = {self.max_in_flight}); the eval "
                    f"function is stuck or slower than training: raise the timeout or use "
                    f'eval.eval_overflow_policy = "skip"'
                )
            return True

    def submit(self, step: int, snapshot: str | Path, *, owned: bool) -> None:
        """Queue ``snapshot`` (``owned``: the pipeline exported it and deletes it when retired)."""
        with self._cv:
            self._pending += 1
        self._queue.put(_Point(step, Path(snapshot), owned))

    def poll(self) -> list[EvalOutcome]:
        with self._cv:
            out = list(self._done)
            self._done.clear()
        return out

    def close(self, timeout_s: Optional[float] = None) -> list[EvalOutcome]:
        """Wait (at most ``timeout_s``, default ``wait_timeout_s``) for pending evals; return the outcomes not
        polled yet. Evals still running after that are abandoned with a warning."""
        t = self.wait_timeout_s if timeout_s is None else timeout_s
        with self._cv:
            finished = self._cv.wait_for(lambda: self._pending == 0, timeout=t)
            left = self._pending
        if not finished:
            log.warning(
                "eval: %d evals still pending after %.0fs at the end of the run (eval.eval_wait_timeout_s); "
                "their points are not logged",
                left,
                t,
            )
        self._queue.put(None)
        if finished:
            self._thread.join(timeout=t)
        return self.poll()

    # ----------------------------------------------------------------- the background thread
    def _run(self) -> None:
        while True:
            p = self._queue.get()
            if p is None:
                return
            out = self._one(p)
            self._retire(p)
            with self._cv:
                self._done.append(out)
                self._pending -= 1
                self._cv.notify_all()

    def _one(self, p: _Point) -> EvalOutcome:
        t0 = time.perf_counter()
        version = snapshot_version(p.snapshot, p.step)
        if version is None:
            with self._cv:
                self.num_skipped += 1
            log.warning("eval point of step %d skipped: %s has no completion marker", p.step, p.snapshot)
            return EvalOutcome(p.step, "skipped", reason="ckpt_missing", snapshot=str(p.snapshot))
        try:
            metrics = _float_metrics(self._evaluate(str(p.snapshot), p.step), p.step)
        except EvalSkip as e:
            with self._cv:
                self.num_skipped += 1
            log.warning("eval point of step %d skipped by the eval function: %s", p.step, e.reason)
            return EvalOutcome(
                p.step, "skipped", reason=e.reason, duration_s=time.perf_counter() - t0, snapshot=str(p.snapshot)
            )
        except Exception as e:  # noqa: BLE001 - user code: logged with its traceback and counted, training goes on
            with self._cv:
                self.num_errors += 1
            log.error(
                "eval point of step %d failed (eval.eval_function_path); training goes on:\n%s",
                p.step,
                traceback.format_exc(),
            )
            return EvalOutcome(
                p.step,
                "error",
                reason=f"{type(e).__name__}: {e}",
                duration_s=time.perf_counter() - t0,
                snapshot=str(p.snapshot),
            )
        with self._cv:
            self.num_completed += 1
        return EvalOutcome(
            p.step,
            "ok",
            metrics=metrics,
            duration_s=time.perf_counter() - t0,
            snapshot=str(p.snapshot),
            weight_version=version,
        )

    def _retire(self, p: _Point) -> None:
        if not p.owned:
            return
        self._retired.append(p.snapshot)
        while len(self._retired) > self.keep_snapshots:
            old = self._retired.popleft()
            try:
                shutil.rmtree(old)
            except OSError as e:  # a snapshot we cannot delete costs disk, not the run
                log.warning("eval: could not delete retired snapshot %s: %s", old, e)


def _float_metrics(metrics: Any, step: int) -> dict[str, float]:
    if not isinstance(metrics, dict):
        raise TypeError(
            f"eval.eval_function_path: evaluate_checkpoint returned {type(metrics).__name__} for step "
            f"{step}, expected dict[str, float]"
        )
    out = {}
    for k, v in metrics.items():
        try:
            out[str(k)] = float(v)
        except (TypeError, ValueError):
            log.warning("eval: metric %r = %r of step %d is not a number; not logged", k, v, step)
    return out


def outcome_metrics(
    out: EvalOutcome, *, logged_at: int, num_skipped: int, num_errors: int, datasets: tuple | list = ()
) -> dict[str, float]:
    """What to log for a finished point, at ``out.step``: its metrics as ``eval/<name>``, ``eval/lag_steps``,
    ``eval/time_seconds``, the running ``eval/skipped`` / ``eval/errors`` counts, ``eval/step``, the skip reason
    (``eval/skipped_<reason>``, ``eval/skipped_crashed``) and each dataset's snapshot weight version."""
    m = {(k if k.startswith("eval/") else f"eval/{k}"): v for k, v in out.metrics.items()}
    m["eval/step"] = float(out.step)
    if out.status == "skipped":
        m[skip_metric(out.reason)] = 1.0
    elif out.status == "error":
        m["eval/skipped_crashed"] = 1.0
    elif out.weight_version is not None:  # a checkpoint backend measured exactly the snapshot's weights
        for name in datasets:
            m[f"eval/{name}/weight_version/mean"] = float(out.weight_version)
            m[f"eval/{name}/weight_version/mixed_version_ratio"] = 0.0
    m["eval/lag_steps"] = float(logged_at - out.step)
    m["eval/time_seconds"] = out.duration_s
    m["eval/skipped"] = float(num_skipped)
    m["eval/errors"] = float(num_errors)
    return m
