"""Nothing lost at rest (issue #41 items 5-7), on whole CPU runs of the embedded default under torchrun:

- a run's checkpoints damaged at rest (a flipped byte in the newest one's model safetensors, a truncated
  meta.json in the one before): the resume names both as damaged, resumes from the newest intact one and trains
  the steps after it again, each step once in metrics.jsonl; retention keeps the newest ``actor.keep_checkpoints``;
- a resume with one changed key is refused before anything starts, naming the key, and a new run over the run's
  checkpoints is refused: the run dir is left as it was;
- a full disk at save (a 14 MiB tmpfs as ``actor.checkpoint_dir``: the first checkpoint fits, the second does
  not): the run fails naming the directory and the free space; the first checkpoint stays intact and no partial one
  is left.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from proc_helpers import assert_nothing_left, read_metrics, run_job

from asyncrl.actor.checkpoint import CheckpointManager, verify_checkpoint


def _out(r: subprocess.CompletedProcess) -> str:
    return r.stdout + r.stderr


def _steps(root: Path) -> list[int]:
    return [int(p.name[5:]) for p in sorted(root.glob("step_*")) if (p / "complete").is_file()]


def _flip_byte(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0xFF
    p.write_bytes(bytes(b))


@pytest.mark.slow
def test_damaged_checkpoints_are_skipped_and_another_config_never_writes_into_the_run(prepared, tmp_path):
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    r = run_job(prepared, run_dir, "runner.max_steps=4", "runner.checkpoint_interval=1")
    assert r.returncode == 0, _out(r)[-6000:]
    assert _steps(root) == [2, 3, 4]  # actor.keep_checkpoints = 3: step 1 deleted
    assert all(verify_checkpoint(CheckpointManager(root).step_dir(s)) is None for s in (2, 3, 4))
    assert not list(root.glob(".partial_*"))

    _flip_byte(root / "step_000004" / "model_tp00.safetensors")  # a corrupt safetensors file
    meta = root / "step_000003" / "meta.json"
    meta.write_text(meta.read_text()[:40])  # a truncated JSON
    r = run_job(prepared, run_dir, "runner.max_steps=5", "runner.checkpoint_interval=1", "runner.resume=true")
    out = _out(r)
    assert r.returncode == 0, out[-6000:]
    assert f"checkpoint {root / 'step_000004'} is damaged (model_tp00.safetensors does not match its sha256" in out
    assert f"checkpoint {root / 'step_000003'} is damaged (meta.json has 40 bytes" in out
    assert f"resumed from {root / 'step_000002'} at step 2" in out
    assert [x["step"] for x in read_metrics(run_dir)] == [1, 2, 3, 4, 5]  # 3 and 4 trained again, each once
    assert _steps(root) == [3, 4, 5]
    assert all(verify_checkpoint(CheckpointManager(root).step_dir(s)) is None for s in (3, 4, 5))

    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and "logs" not in p.parts}
    r = run_job(prepared, run_dir, "runner.max_steps=6", "runner.resume=true", "actor.lr=0.0005", timeout_s=120)
    assert r.returncode != 0, _out(r)[-6000:]
    assert "config error: runner.resume: " in _out(r) and "actor.lr: 0.0002 -> 0.0005" in _out(r), _out(r)[-6000:]
    r = run_job(prepared, run_dir, "runner.max_steps=6", timeout_s=120)  # a new run: would write over them
    assert r.returncode != 0 and "holds checkpoints of run" in _out(r), _out(r)[-6000:]
    after = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and "logs" not in p.parts}
    changed = sorted(str(p) for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    assert not changed, changed  # refused before anything starts: nothing written
    assert_nothing_left(run_dir, within_s=30)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 14 MiB tmpfs (root only), unmounted at teardown."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=14m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_a_full_disk_at_save_names_the_directory_and_its_free_space(prepared, tmp_path, tiny_disk):
    run_dir = tmp_path / "run"
    r = run_job(
        prepared,
        run_dir,
        "runner.max_steps=3",
        "runner.checkpoint_interval=1",
        f'actor.checkpoint_dir="{tiny_disk}"',
    )
    out = _out(r)
    assert r.returncode != 0, out[-6000:]
    assert f"writing the checkpoint of step 2 into '{tiny_disk / '.partial_step_000002'}' failed" in out, out[-6000:]
    assert f"the file system of '{tiny_disk}' has " in out and " MiB free of 14.0 MiB" in out
    assert _steps(tiny_disk) == [1] and verify_checkpoint(tiny_disk / "step_000001") is None
    assert not list(tiny_disk.glob(".partial_*"))  # the partial checkpoint was removed
    assert_nothing_left(run_dir, within_s=60)
