"""Run identity and exact resume: which checkpoint a run continues from, and the metrics it rewrites.

Contract
- A run's identity is ``{"run_id", "config_hash"}``. ``config_hash`` hashes the resolved config minus
  the keys a resume may change (``RESUMABLE_KEYS``: the step budget, the resume switches, the non-finite
  tolerance, the engine port, the logging and cluster sections). ``establish_identity`` (actor rank 0, before anything is logged) keeps the run id found in
  ``<run_dir>/run.json`` when resuming the same config, and starts a new run id otherwise; it writes
  ``run.json``. Every checkpoint gets the same ``run.json`` before its ``complete``, and
  ``asyncrl.actor.checkpoint.CheckpointManager.pick`` resumes only checkpoints with this identity (other runs'
  in the directory are skipped and logged); when the run has none yet, ``runner.resume_from``; else None.
- ``check_resume(cfg)`` (every rank, at launch, before any process starts; reads only): ``runner.resume``'s decision
  as one line to log, or a ``ConfigError`` naming the directory. ``"auto"``: resume this run's newest complete
  checkpoint when the checkpoint directory holds one (same run id and config hash as ``<run_dir>/run.json``), else
  start at step 1 (or from ``runner.resume_from``) and say so; ``true``: the same, but no checkpoint of this run
  and no ``resume_from`` is an error; ``false``: start at step 1, and a checkpoint directory that already holds
  complete checkpoints (of any run: a fresh run would write beside them and over its metrics) is an error.
  Which checkpoints exist is asked of ``CheckpointManager`` (its root, ``complete_checkpoints``, ``is_complete``).
- ``purge_jsonl(path, after_step)``: drops the records of steps after the resumed one (they are
  written again), atomically; TensorBoard does the same through ``SummaryWriter(purge_step=...)``.

    ident = establish_identity(cfg, run_dir)
    ckpt = CheckpointManager(root).pick(ident, resume=cfg.runner.resume, resume_from=cfg.runner.resume_from)
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from pathlib import Path

from asyncrl.actor.checkpoint import CheckpointManager, read_identity, write_identity
from asyncrl.config import ConfigError
from asyncrl.config.loader import to_dict

log = logging.getLogger("asyncrl.trainer")

RESUMABLE_KEYS = (
    "runner.max_steps",
    "runner.resume",
    "runner.resume_from",
    "runner.max_nonfinite_steps",
    "rollout.port",
    "logging",
    "cluster",
)
"""Keys (or whole sections) a resumed run may change: the step budget, the resume switches, where it runs and
logs (ports, placement, timeouts)."""


def config_hash(cfg) -> str:
    """sha256 (16 hex digits) of the resolved config without ``RESUMABLE_KEYS``."""
    d = to_dict(cfg)
    for key in RESUMABLE_KEYS:
        section, _, name = key.partition(".")
        if not name:
            d.pop(section, None)
        elif isinstance(d.get(section), dict):
            d[section].pop(name, None)
    blob = json.dumps(d, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def establish_identity(cfg, run_dir: Path) -> dict:
    """This run's identity: the one in ``run_dir`` when resuming with the same config, else a new run id."""
    h = config_hash(cfg)
    old = read_identity(run_dir)
    resuming = cfg.runner.resume or cfg.runner.resume_from is not None
    if resuming and old is not None and old["config_hash"] == h:
        return {"run_id": old["run_id"], "config_hash": h}
    if old is not None and resuming:
        log.warning(
            "run dir %s holds run %s of another config (hash %s, now %s): starting a new run; its "
            "checkpoints are not resumed (set runner.resume_from to start from one)",
            run_dir,
            old["run_id"],
            old["config_hash"],
            h,
        )
    ident = {"run_id": uuid.uuid4().hex[:12], "config_hash": h}
    write_identity(run_dir, ident)
    return ident


def checkpoint_root(cfg) -> Path:
    """Where the run's checkpoints live: ``actor.checkpoint_dir``, default ``<logging.run_dir>/checkpoints``."""
    return Path(cfg.actor.checkpoint_dir or Path(cfg.logging.run_dir) / "checkpoints")


def check_resume(cfg) -> str:
    """``runner.resume``'s decision for this config and its run directory, as a line to log; a ``ConfigError``
    naming the directory when it cannot be honoured (see the module contract). Reads only."""
    mode, run_dir = cfg.runner.resume, Path(cfg.logging.run_dir)
    ckpts = CheckpointManager(checkpoint_root(cfg))
    old = read_identity(run_dir)
    own = ckpts.complete_checkpoints(old) if old is not None and old["config_hash"] == config_hash(cfg) else []
    if mode is False:
        present = (
            sorted(p.name for p in ckpts.root.glob("step_*") if ckpts.is_complete(p)) if ckpts.root.is_dir() else []
        )
        if present:
            raise ConfigError(
                f"runner.resume = false, but {ckpts.root} already holds complete checkpoints ({', '.join(present)}) "
                f"of run {old['run_id'] if old else '(unknown)'}: a fresh run would write beside them and over their "
                f'metrics. Set runner.resume = "auto" (or true) to continue that run, or choose another '
                f"logging.run_dir (RUN_NAME with launch/slurm/searchr1.sbatch), or move those checkpoints away"
            )
        return "runner.resume = false: starting at step 1"
    if own:
        return f"runner.resume = {_mode(mode)}: resuming run {old['run_id']} from its checkpoint {own[-1]}"
    start = f"from runner.resume_from = {cfg.runner.resume_from}" if cfg.runner.resume_from else "at step 1"
    if mode is True and not cfg.runner.resume_from:
        raise ConfigError(
            f"runner.resume = true, but {ckpts.root} holds no complete checkpoint of this run (run.json in "
            f'{run_dir}: {old or "none"}); set runner.resume = "auto" to start at step 1 when there is none, '
            f"runner.resume_from to start from a checkpoint, or logging.run_dir to the run to continue"
        )
    return f"runner.resume = {_mode(mode)}: no complete checkpoint of this run in {ckpts.root}; starting {start}"


def _mode(mode) -> str:
    return '"auto"' if mode == "auto" else "true"


def purge_jsonl(path: Path, after_step: int) -> int:
    """Drop the records of steps > ``after_step`` from a metrics.jsonl; returns how many were dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            step = json.loads(line).get("step", 0)
        except (ValueError, AttributeError):
            keep.append(line)
            continue
        if isinstance(step, (int, float)) and step > after_step:
            dropped += 1
        else:
            keep.append(line)
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(path)
    return dropped
