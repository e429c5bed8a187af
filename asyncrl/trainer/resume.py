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
  and no ``resume_from`` is an error; ``false``: start at step 1 (a run directory holding another run's checkpoints is
  ``check_run_dir``'s to refuse, or to archive with ``runner.archive_previous``).
  Which checkpoints exist is asked of ``CheckpointManager`` (its root, ``complete_checkpoints``, ``is_complete``).
- Nothing of another run is written into (``check_run_dir``, run by the launcher on every rank before anything
  starts, read only, and again by ``establish_identity`` on actor rank 0, which also archives):
  - resuming (``runner.resume``/``resume_from``) a run dir whose run has another config, while its checkpoints or
    metrics are there, is refused naming the differing keys (``ConfigError``): resuming would mix two configs
    in one run's checkpoints and metrics, and a new directory made silently would look like a resume that
    starts at step 1;
  - a new run in a run dir (or ``actor.checkpoint_dir``) holding another run's complete checkpoints is refused
    unless ``runner.archive_previous = true``;
  - with ``runner.archive_previous``, or when the previous run left only metrics (no checkpoint to lose by
    mistake), its metrics.jsonl, tensorboard/ and summary.json move to ``<run_dir>/previous/<run id>/`` and its
    checkpoints to ``<checkpoint dir>/previous/<run id>/``: the new run starts clean and nothing is deleted.
- ``purge_jsonl(path, after_step)``: drops the records of steps after the resumed one (they are
  written again), atomically; TensorBoard does the same through ``SummaryWriter(purge_step=...)``.

    check_run_dir(cfg)  # every rank, before anything starts
    ident = establish_identity(cfg, run_dir, checkpoints=CheckpointManager(root))  # actor rank 0
    ckpt = CheckpointManager(root).pick(ident, resume=cfg.runner.resume, resume_from=cfg.runner.resume_from)
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from pathlib import Path

from asyncrl.actor.checkpoint import CheckpointManager, read_identity, read_run_config, write_identity
from asyncrl.config import ConfigError
from asyncrl.config.loader import to_dict

log = logging.getLogger("asyncrl.trainer")

RESUMABLE_KEYS = (
    "runner.max_steps",
    "runner.resume",
    "runner.resume_from",
    "runner.archive_previous",
    "runner.max_nonfinite_steps",
    "actor.keep_checkpoints",
    "rollout.port",
    "logging",
    "cluster",
)
"""Keys (or whole sections) a resumed run may change: the step budget, the resume switches, the retention, where
it runs and logs (ports, placement, timeouts)."""

RUN_ARTEFACTS = ("metrics.jsonl", "tensorboard", "summary.json")
"""What a run writes into its run dir that a new run there would append to or overwrite (archived, see contract)."""


def hashed_config(cfg) -> dict:
    """The resolved config without ``RESUMABLE_KEYS``, as JSON values: what ``config_hash`` hashes."""
    d = to_dict(cfg)
    for key in RESUMABLE_KEYS:
        section, _, name = key.partition(".")
        if not name:
            d.pop(section, None)
        elif isinstance(d.get(section), dict):
            d[section].pop(name, None)
    return json.loads(json.dumps(d, default=str))


def _hash(conf: dict) -> str:
    return hashlib.sha256(json.dumps(conf, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_hash(cfg) -> str:
    """sha256 (16 hex digits) of the resolved config without ``RESUMABLE_KEYS``."""
    return _hash(hashed_config(cfg))


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def config_changes(old: dict | None, new: dict) -> list[str]:
    """``key: old -> new`` for every dotted key whose value differs (empty when ``old`` is unknown)."""
    if old is None:
        return []
    a, b = _flat(old), _flat(new)
    missing = "(unset)"
    return [
        f"{k}: {a.get(k, missing)!r} -> {b.get(k, missing)!r}"
        for k in sorted(a.keys() | b.keys())
        if a.get(k, missing) != b.get(k, missing)
    ]


def _checkpoints(cfg, run_dir: Path) -> CheckpointManager:
    return CheckpointManager(cfg.actor.checkpoint_dir or Path(run_dir) / "checkpoints")


def _previous_run(cfg, run_dir: Path, ckpts: CheckpointManager) -> tuple[dict | None, list[Path], list[Path]]:
    """What a run that is not continuing the run dir's run would find: that run's identity, the complete
    checkpoints under the checkpoint root and the run artefacts in the run dir."""
    old = read_identity(run_dir)
    resuming = cfg.runner.resume or cfg.runner.resume_from is not None
    if resuming and old is not None and old["config_hash"] == config_hash(cfg):
        return old, [], []  # the same run, continued: its files are its own
    return old, ckpts.foreign_checkpoints(None), [run_dir / n for n in RUN_ARTEFACTS if (run_dir / n).exists()]


def check_run_dir(cfg, run_dir: Path | None = None) -> None:
    """Refuse (``ConfigError``) a run that would write into another run's checkpoints or metrics (see the module
    contract). Reads only: the launcher runs it on every rank before anything starts."""
    run_dir = Path(run_dir or cfg.logging.run_dir)
    ckpts = _checkpoints(cfg, run_dir)
    old, foreign, artefacts = _previous_run(cfg, run_dir, ckpts)
    if cfg.runner.archive_previous or not (foreign or artefacts):
        return
    who = f"run {old['run_id']}" if old else "an earlier run"
    steps = ", ".join(p.name for p in foreign[-4:])
    how = (
        "use another logging.run_dir (runner.resume_from = <one of its checkpoints> starts from its weights), or "
        "set runner.archive_previous = true to move its files to previous/ and start a new run here"
    )
    resuming = cfg.runner.resume or cfg.runner.resume_from is not None
    if resuming and old is not None:
        changes = config_changes(read_run_config(run_dir), hashed_config(cfg))
        what = "; ".join(changes[:12]) + (f"; and {len(changes) - 12} more" if len(changes) > 12 else "")
        raise ConfigError(
            f"runner.resume: {str(run_dir)!r} holds {who} of another config "
            f"({what or 'config hash ' + old['config_hash'] + ' vs ' + config_hash(cfg) + ', its keys unrecorded'})"
            f": resuming it would write this config's steps into its checkpoints and metrics. Change back the keys "
            f"(a resume may change only {', '.join(RESUMABLE_KEYS)}), or {how}"
        )
    if foreign:
        raise ConfigError(
            f"runner.resume: {str(ckpts.root)!r} holds checkpoints of {who} ({steps}) and this is a new run (not "
            "resuming a run of this config in this run dir) that would write over them; set runner.resume = true "
            f"to continue that run (same config), or {how}"
        )


def _archive(paths: list[Path], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for p in paths:
        p.rename(dest / p.name)
    log.warning("moved %s of the previous run to %s", ", ".join(p.name for p in paths), dest)


def _free_name(root: Path, name: str) -> Path:
    d, n = root / "previous" / name, 1
    while d.exists():
        n += 1
        d = root / "previous" / f"{name}-{n}"
    return d


def establish_identity(cfg, run_dir: Path, checkpoints: CheckpointManager | None = None) -> dict:
    """This run's identity: the one in ``run_dir`` when resuming with the same config, else a new run id. With
    ``checkpoints`` (the run's manager) it first refuses or archives what a previous run left (``check_run_dir``)."""
    conf = hashed_config(cfg)
    h = _hash(conf)
    old = read_identity(run_dir)
    resuming = cfg.runner.resume or cfg.runner.resume_from is not None
    if resuming and old is not None and old["config_hash"] == h:
        ident = {"run_id": old["run_id"], "config_hash": h}
        write_identity(run_dir, ident, config=conf)
        return ident
    if checkpoints is not None:
        check_run_dir(cfg, run_dir)
        _, foreign, artefacts = _previous_run(cfg, run_dir, checkpoints)
        name = old["run_id"] if old else "unknown"
        if artefacts:
            _archive(artefacts, _free_name(Path(run_dir), name))
        if foreign:
            _archive(foreign, _free_name(checkpoints.root, name))
    elif old is not None and resuming:
        log.warning("run dir %s holds run %s of another config: starting a new run", run_dir, old["run_id"])
    ident = {"run_id": uuid.uuid4().hex[:12], "config_hash": h}
    write_identity(run_dir, ident, config=conf)
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
    if mode is False:  # another run's checkpoints here: check_run_dir refuses (or archives) them
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
