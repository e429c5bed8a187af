"""Exact resume: a run resumes only its own checkpoints (run id + config hash), or an explicit path; the
checkpoint manager's markers and listing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from asyncrl.actor.checkpoint import CheckpointManager, write_identity, write_meta
from asyncrl.config import load_config
from asyncrl.trainer.resume import config_hash, establish_identity

ROOT = Path(__file__).resolve().parents[2]


def _cfg(*overrides):
    return load_config(ROOT / "configs/tiny.toml", list(overrides))


def pick_checkpoint(cfg, root: Path, ident: dict) -> Path | None:
    return CheckpointManager(root).pick(ident, resume=cfg.runner.resume, resume_from=cfg.runner.resume_from)


def _ckpt(root: Path, step: int, ident: dict | None, *, complete: bool = True) -> Path:
    """A checkpoint as the manager lays it out (the actor's own files left out: nothing here loads them)."""
    d = CheckpointManager(root).step_dir(step)
    d.mkdir(parents=True)
    write_meta(d, {"step": step, "weight_version": step})
    if ident is not None:
        write_identity(d, ident)
    if complete:
        (d / "complete").write_text("ok\n")
    return d


def test_resume_skips_another_runs_newer_checkpoint(tmp_path):
    """The old rule took the highest-numbered complete checkpoint in the directory, whoever wrote it."""
    cfg = _cfg("runner.resume=true")
    ident = establish_identity(cfg, tmp_path)
    root = tmp_path / "checkpoints"
    own = _ckpt(root, 4, ident)
    _ckpt(root, 8, {"run_id": "someoneelse", "config_hash": ident["config_hash"]})
    _ckpt(root, 9, None)  # written before checkpoints carried an identity
    _ckpt(root, 6, {"run_id": ident["run_id"], "config_hash": "0" * 16})
    assert pick_checkpoint(cfg, root, ident) == own


def test_identity_survives_a_restart_but_not_a_config_change(tmp_path):
    cfg = _cfg("runner.resume=true")
    first = establish_identity(cfg, tmp_path)
    assert (
        establish_identity(dataclasses.replace(cfg, runner=dataclasses.replace(cfg.runner, max_steps=99)), tmp_path)
        == first
    )  # a longer budget is the same run
    assert establish_identity(_cfg("runner.resume=true", "rollout.port=45678"), tmp_path) == first  # a new port
    other = _cfg("runner.resume=true", "actor.lr=0.5")
    assert config_hash(other) != first["config_hash"]
    assert establish_identity(other, tmp_path)["run_id"] != first["run_id"]
    fresh = establish_identity(_cfg(), tmp_path)  # no resume: always a new run
    assert fresh["run_id"] != first["run_id"]


def test_resume_from_is_used_until_the_run_has_its_own(tmp_path):
    foreign = _ckpt(tmp_path / "elsewhere", 5, {"run_id": "x", "config_hash": "y"})
    cfg = _cfg(f'runner.resume_from="{foreign}"')
    ident = establish_identity(cfg, tmp_path / "run")
    root = tmp_path / "run" / "checkpoints"
    assert pick_checkpoint(cfg, root, ident) == foreign
    own = _ckpt(root, 7, ident)
    assert pick_checkpoint(cfg, root, ident) == own
    assert pick_checkpoint(_cfg(), root, ident) is None  # neither switch: start at step 0


def test_the_manager_lists_only_complete_checkpoints_in_step_order(tmp_path):
    ident = {"run_id": "r", "config_hash": "h"}
    mgr = CheckpointManager(tmp_path / "checkpoints")
    assert mgr.complete_checkpoints(ident) == []  # no directory yet
    for step in (10, 2, 30):
        _ckpt(mgr.root, step, ident)
    _ckpt(mgr.root, 40, ident, complete=False)  # interrupted: never resumed
    (mgr.root / "step_junk").mkdir()
    assert [p.name for p in mgr.complete_checkpoints(ident)] == ["step_000002", "step_000010", "step_000030"]
    assert mgr.step_dir(30) == mgr.root / "step_000030" and mgr.step_of(mgr.step_dir(30)) == 30
    assert mgr.is_complete(mgr.step_dir(30)) and not mgr.is_complete(mgr.step_dir(40))


def test_exported_version_reads_the_checkpoint_meta_of_an_hf_export(tmp_path):
    mgr = CheckpointManager(tmp_path)
    d = _ckpt(tmp_path, 6, None)
    assert mgr.exported_version(mgr.hf_export(6)) == 6
    assert mgr.exported_version(mgr.hf_export(7)) is None  # no meta.json: the export's checkpoint is unfinished
    assert mgr.exported_version(d) is None  # not an hf_export
    (d / "meta.json").write_text("{not json")
    assert mgr.exported_version(mgr.hf_export(6)) is None
