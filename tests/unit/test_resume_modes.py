"""``runner.resume`` = "auto" | true | false, decided at launch from what the checkpoint directory holds
(``asyncrl.trainer.resume.check_resume``): real files laid out as ``CheckpointManager`` writes them."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.actor.checkpoint import CheckpointManager, write_identity, write_meta
from asyncrl.config import ConfigError, load_config
from asyncrl.trainer.resume import check_resume, check_run_dir, config_hash, hashed_config

ROOT = Path(__file__).resolve().parents[2]


def _cfg(run_dir: Path, *overrides: str):
    return load_config(ROOT / "configs/tiny.toml", [f'logging.run_dir="{run_dir}"', *overrides])


def _ckpt(run_dir: Path, step: int, ident: dict, *, complete: bool = True) -> Path:
    d = CheckpointManager(run_dir / "checkpoints").step_dir(step)
    d.mkdir(parents=True)
    write_meta(d, {"step": step, "weight_version": step})
    write_identity(d, ident)
    if complete:
        (d / "complete").write_text("ok\n")
    return d


def _run(run_dir: Path, cfg) -> dict:
    """A run that wrote its identity in ``run_dir`` as ``establish_identity`` does: with its hashed config (a resume
    must still find the run's checkpoints, whose run.json holds the identity alone)."""
    ident = {"run_id": "abc123", "config_hash": config_hash(cfg)}
    write_identity(run_dir, ident, config=hashed_config(cfg))
    return ident


def test_resume_modes_parse_and_reject_other_values(tmp_path):
    assert _cfg(tmp_path, 'runner.resume="auto"').runner.resume == "auto"
    assert _cfg(tmp_path, "runner.resume=true").runner.resume is True
    assert _cfg(tmp_path).runner.resume is False
    with pytest.raises(ConfigError, match="runner.resume: expected 'auto' or bool"):
        _cfg(tmp_path, 'runner.resume="yes"')


def test_auto_resumes_this_runs_newest_checkpoint_and_says_so(tmp_path):
    cfg = _cfg(tmp_path, 'runner.resume="auto"')
    assert "no complete checkpoint of this run" in check_resume(cfg) and "starting at step 1" in check_resume(cfg)
    ident = _run(tmp_path, cfg)
    _ckpt(tmp_path, 3, ident)
    newest = _ckpt(tmp_path, 6, ident)
    _ckpt(tmp_path, 9, ident, complete=False)  # a save cut short: not resumed
    assert check_resume(cfg) == f'runner.resume = "auto": resuming run abc123 from its checkpoint {newest}'
    # a longer step budget is the same run (runner.max_steps is a resumable key)
    assert str(newest) in check_resume(_cfg(tmp_path, 'runner.resume="auto"', "runner.max_steps=99"))


def test_true_without_a_checkpoint_of_this_run_names_the_directory(tmp_path):
    cfg = _cfg(tmp_path, "runner.resume=true")
    with pytest.raises(ConfigError, match=f"runner.resume = true, but {tmp_path / 'checkpoints'} holds no complete"):
        check_resume(cfg)
    ident = _run(tmp_path, cfg)
    _ckpt(tmp_path, 2, ident, complete=False)
    with pytest.raises(ConfigError, match='set runner.resume = "auto"'):
        check_resume(cfg)
    done = _ckpt(tmp_path, 4, ident)
    assert check_resume(cfg).endswith(str(done))


def test_true_with_resume_from_starts_from_it(tmp_path):
    other = _ckpt(tmp_path / "old", 5, {"run_id": "x", "config_hash": "y"})
    cfg = _cfg(tmp_path / "new", "runner.resume=true", f'runner.resume_from="{other}"')
    assert check_resume(cfg).endswith(f"starting from runner.resume_from = {other}")


def test_false_refuses_a_directory_with_another_runs_checkpoints(tmp_path):
    """``false`` starts at step 1; a directory holding a complete checkpoint of another run (the earlier run of the
    same config included: a new run gets a new run id) is refused by ``check_run_dir``, which the launcher runs
    before ``check_resume``."""
    cfg = _cfg(tmp_path)
    assert check_resume(cfg) == "runner.resume = false: starting at step 1"
    ident = _run(tmp_path, cfg)
    _ckpt(tmp_path, 1, ident, complete=False)
    check_run_dir(cfg)  # nothing complete to lose
    _ckpt(tmp_path, 3, ident)
    with pytest.raises(ConfigError) as e:
        check_run_dir(cfg)
    msg = str(e.value)
    assert msg.startswith(f"runner.resume: {str(tmp_path / 'checkpoints')!r} holds checkpoints of run abc123"), msg
    assert "this is a new run" in msg
    assert check_resume(cfg) == "runner.resume = false: starting at step 1"


def test_checkpoint_dir_setting_is_where_resume_looks(tmp_path):
    ckpt_dir = tmp_path / "elsewhere"
    cfg = _cfg(tmp_path / "run", 'runner.resume="auto"', f'actor.checkpoint_dir="{ckpt_dir}"')
    ident = _run(tmp_path / "run", cfg)
    d = CheckpointManager(ckpt_dir).step_dir(7)
    d.mkdir(parents=True)
    write_meta(d, {"step": 7, "weight_version": 7})
    write_identity(d, ident)
    (d / "complete").write_text("ok\n")
    assert check_resume(cfg).endswith(str(d))
