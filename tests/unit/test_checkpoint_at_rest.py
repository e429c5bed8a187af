"""Nothing lost at rest (issue #41 items 5-7): sealed checkpoints (manifest of sizes and sha256, ``complete`` naming
the manifest's checksum) are verified at resume and a damaged one is skipped for the newest intact one; a file
that cannot be read is named; retention deletes only this run's older checkpoints; a run never writes into
another run's checkpoints or metrics (a changed config on resume is refused naming the keys, a new run over
another run's checkpoints is refused unless ``runner.archive_previous``, which moves them aside)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from asyncrl.actor.checkpoint import (
    CheckpointError,
    CheckpointManager,
    read_meta,
    seal_checkpoint,
    verify_checkpoint,
    write_identity,
    write_meta,
)
from asyncrl.config import ConfigError, load_config
from asyncrl.trainer.resume import check_run_dir, establish_identity

ROOT = Path(__file__).resolve().parents[2]


def _cfg(run_dir: Path, *overrides: str):
    return load_config(ROOT / "configs/tiny.toml", [f'logging.run_dir="{run_dir}"', *overrides])


def _sealed(mgr: CheckpointManager, step: int, ident: dict) -> Path:
    """A checkpoint as ``CheckpointManager.save`` leaves it: files, identity, manifest, ``complete``."""
    d = mgr.step_dir(step)
    (d / "hf").mkdir(parents=True)
    write_meta(d, {"step": step, "weight_version": step})
    (d / "model_tp00.safetensors").write_bytes(bytes(range(256)) * 64)
    (d / "hf" / "config.json").write_text('{"vocab_size": 8}\n')
    write_identity(d, ident)
    seal_checkpoint(d)
    return d


def _flip_byte(p: Path, at: int = 100) -> None:
    b = bytearray(p.read_bytes())
    b[at] ^= 0xFF
    p.write_bytes(bytes(b))


IDENT = {"run_id": "r1", "config_hash": "h1"}


def test_a_sealed_checkpoint_verifies_and_each_kind_of_damage_is_named(tmp_path):
    mgr = CheckpointManager(tmp_path)
    d = _sealed(mgr, 3, IDENT)
    assert (d / "complete").read_text().startswith("sha256 ") and verify_checkpoint(d) is None
    _flip_byte(d / "model_tp00.safetensors")  # same size, other bytes
    assert verify_checkpoint(d) == "model_tp00.safetensors does not match its sha256 in manifest.json"
    d = _sealed(mgr, 4, IDENT)
    (d / "meta.json").write_text((d / "meta.json").read_text()[:10])  # truncated JSON
    assert "meta.json has 10 bytes, its manifest says" in verify_checkpoint(d)
    d = _sealed(mgr, 5, IDENT)
    (d / "hf" / "config.json").unlink()
    assert verify_checkpoint(d) == "hf/config.json is missing"
    d = _sealed(mgr, 6, IDENT)
    (d / "manifest.json").write_text("{}")
    assert verify_checkpoint(d) == "manifest.json does not match the checksum in complete"
    legacy = mgr.step_dir(7)
    legacy.mkdir()
    (legacy / "complete").write_text("ok\n")  # written before checkpoints carried a manifest: not verified
    assert verify_checkpoint(legacy) is None


def test_resume_skips_a_damaged_newest_checkpoint_for_the_newest_intact_one(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path / "checkpoints")
    _sealed(mgr, 3, IDENT)
    intact = _sealed(mgr, 6, IDENT)
    newest = _sealed(mgr, 9, IDENT)
    _flip_byte(newest / "model_tp00.safetensors")
    with caplog.at_level(logging.WARNING):
        assert mgr.pick(IDENT, resume=True, resume_from=None) == intact
    assert f"checkpoint {newest} is damaged (model_tp00.safetensors does not match" in caplog.text
    for d in (intact, mgr.step_dir(3)):
        (d / "broker_state.bin").write_bytes(b"x")  # a file the manifest does not list is not checked ...
        (d / "manifest.json").unlink()  # ... but a missing manifest is damage
    with pytest.raises(CheckpointError, match="every checkpoint of this run under .* is damaged") as e:
        mgr.pick(IDENT, resume=True, resume_from=None)
    assert str(newest) in str(e.value) and "manifest.json is missing" in str(e.value)
    fallback = _sealed(CheckpointManager(tmp_path / "other"), 2, {"run_id": "x", "config_hash": "y"})
    assert mgr.pick(IDENT, resume=True, resume_from=str(fallback)) == fallback
    _flip_byte(fallback / "model_tp00.safetensors")
    with pytest.raises(CheckpointError, match=r"runner.resume_from = .*step_000002.*damaged"):
        mgr.pick(IDENT, resume=True, resume_from=str(fallback))


def test_an_unreadable_file_is_named(tmp_path):
    d = _sealed(CheckpointManager(tmp_path), 1, IDENT)
    (d / "meta.json").write_text('{"format": "asyncrl-act')
    with pytest.raises(CheckpointError, match=f"checkpoint file '{d / 'meta.json'}' cannot be read: JSONDecodeError"):
        read_meta(d)


def test_retention_deletes_only_this_runs_older_checkpoints(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2)
    other = {"run_id": "r0", "config_hash": "h1"}
    foreign = _sealed(mgr, 1, other)
    for step in (2, 4, 6, 8):
        _sealed(mgr, step, IDENT)
    (tmp_path / ".partial_step_000010").mkdir()  # a save in progress is not a checkpoint
    assert [p.name for p in mgr.prune(IDENT)] == ["step_000002", "step_000004"]
    assert [p.name for p in mgr.complete_checkpoints(IDENT)] == ["step_000006", "step_000008"]
    assert foreign.is_dir() and mgr.prune(IDENT) == [] and CheckpointManager(tmp_path).prune(IDENT) == []  # 0: all


def _run(run_dir: Path, *overrides: str) -> tuple[object, dict, CheckpointManager]:
    cfg = _cfg(run_dir, *overrides)
    mgr = CheckpointManager(run_dir / "checkpoints")
    return cfg, establish_identity(cfg, run_dir, mgr), mgr


def test_a_resume_with_a_changed_key_is_refused_naming_it(tmp_path):
    cfg, ident, mgr = _run(tmp_path, "runner.resume=true")
    _sealed(mgr, 3, ident)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    changed = _cfg(tmp_path, "runner.resume=true", "actor.lr=0.5", "runner.max_steps=90")
    with pytest.raises(ConfigError, match=r"holds run r?\w+ of another config \(actor.lr: 0.0002 -> 0.5\)"):
        check_run_dir(changed)
    with pytest.raises(ConfigError, match="actor.lr"):  # actor rank 0 checks again before writing anything
        establish_identity(changed, tmp_path, mgr)
    assert json.loads((tmp_path / "run.json").read_text())["run_id"] == ident["run_id"]
    check_run_dir(_cfg(tmp_path, "runner.resume=true", "runner.max_steps=90"))  # a resumable key: the same run


def test_a_new_run_over_another_runs_checkpoints_is_refused_unless_told_then_archived(tmp_path):
    cfg, first, mgr = _run(tmp_path)
    old = _sealed(mgr, 3, first)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "tensorboard").mkdir()
    with pytest.raises(ConfigError, match=rf"holds checkpoints of run {first['run_id']} \(step_000003\)"):
        check_run_dir(cfg)
    told = _cfg(tmp_path, "runner.archive_previous=true")
    check_run_dir(told)
    second = establish_identity(told, tmp_path, mgr)
    assert second["run_id"] != first["run_id"] and not old.exists() and not (tmp_path / "metrics.jsonl").exists()
    kept = mgr.root / "previous" / first["run_id"] / "step_000003"
    assert verify_checkpoint(kept) is None
    assert sorted(p.name for p in (tmp_path / "previous" / first["run_id"]).iterdir()) == [
        "metrics.jsonl",
        "tensorboard",
    ]


def test_a_previous_run_with_metrics_only_is_archived_not_appended_to(tmp_path):
    _, first, _ = _run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    check_run_dir(_cfg(tmp_path))  # no checkpoint to lose by mistake: no refusal
    _, second, _ = _run(tmp_path)
    assert (tmp_path / "previous" / first["run_id"] / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert not (tmp_path / "metrics.jsonl").exists() and second["run_id"] != first["run_id"]
