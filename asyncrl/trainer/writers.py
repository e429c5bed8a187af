"""One metrics interface for every component: ``log(metrics, step)`` and ``close()``.

Backends: TensorBoard event files (readable by tensorboard's EventAccumulator), a JSONL file in
the run directory (one record per step: ``{"step": n, "time": t, <name>: value, ...}``), one
fixed-format console line per step and, with ``wandb=`` (``logging.wandb``), a Weights & Biases run with the same
names at the same steps (``asyncrl.trainer.wandb_sink``). Keys are slash-namespaced (``rollout/data_staleness/mean``).
A configured sink that fails raises: silent metric loss is worse than a crash (wandb fails at construction, so at
the run's start). ``purge_step=n`` (a resumed run) drops the records of steps >= n from metrics.jsonl and
TensorBoard before writing.

    w = MetricsWriter("runs/x", tensorboard=True, jsonl=True, console=True)
    w.log({"reward/mean": 0.4, "time/step": 1.2}, step=3)
    w.close()
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import TextIO

from asyncrl.trainer.tb_layout import custom_scalars_layout
from asyncrl.trainer.wandb_sink import WandbSink  # light: it imports wandb itself, only when a run starts

# Keys shown on the one-line console progress, in this order, when present.
CONSOLE_KEYS = (
    ("reward/mean", "reward"),
    ("train/loss", "loss"),
    ("train/grad_norm", "gnorm"),
    ("rollout/data_staleness/mean", "stale"),
    ("rollout/fully_async/queue_size", "queue"),
    ("time/step", "t_step"),
    ("time/training", "t_train"),
    ("time/wait_data", "t_wait"),
    ("time/rollout", "t_roll"),
    ("time/sync_weights", "t_sync"),
)


def _scalar(value) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item):
        try:
            return float(item())
        except (TypeError, ValueError):
            return None
    return None


class MetricsWriter:
    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        jsonl: bool = True,
        console: bool = True,
        console_stream: TextIO | None = None,
        max_steps: int | None = None,
        purge_step: int | None = None,
        wandb=None,
        config: dict | None = None,
        run_id: str | None = None,
    ):
        """``wandb``: a ``WandbConfig`` (None or ``mode = "disabled"``: no wandb run); ``config`` (the resolved config)
        and ``run_id`` (the run's id) are the wandb run's config and id."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._tb = None
        if purge_step is not None:  # a resumed run writes these steps again: drop the old ones
            from asyncrl.trainer.resume import purge_jsonl

            purge_jsonl(self.run_dir / "metrics.jsonl", purge_step - 1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # heavy import, only when used

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=purge_step)
            self._tb.add_custom_scalars(custom_scalars_layout())  # CUSTOM SCALARS tab: the health charts first
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a") if jsonl else None  # noqa: SIM115
        self._console = (console_stream or sys.stdout) if console else None
        self._max_steps = max_steps
        self._t0 = time.time()
        self._wandb = None
        if wandb is not None and wandb.mode != "disabled":  # last: a sink that fails to start fails the run
            try:
                self._wandb = WandbSink(wandb, self.run_dir, config=config, run_id=run_id)
            except Exception:
                self.close()
                raise

    def log(self, metrics: dict, step: int) -> None:
        clean = {}
        for k, v in metrics.items():
            x = _scalar(v)
            if x is not None:
                clean[k] = x
        if self._tb is not None:
            for k, x in clean.items():
                self._tb.add_scalar(k, x, global_step=step)
            self._tb.flush()
        if self._jsonl is not None:
            rec = {"step": step, "time": round(time.time() - self._t0, 3)}
            rec.update({k: (x if math.isfinite(x) else str(x)) for k, x in clean.items()})
            self._jsonl.write(json.dumps(rec) + "\n")
            self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step)
        if self._console is not None:
            self._console.write(format_console_line(clean, step, self._max_steps) + "\n")
            self._console.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None


def format_console_line(metrics: dict[str, float], step: int, max_steps: int | None = None) -> str:
    head = f"step {step}" + (f"/{max_steps}" if max_steps else "")
    parts = [head]
    for key, short in CONSOLE_KEYS:
        if key in metrics:
            parts.append(f"{short} {metrics[key]:.4g}")
    return " | ".join(parts)
