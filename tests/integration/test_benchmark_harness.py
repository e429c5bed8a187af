"""The benchmark harness's tiny jobs (``benchmarks/harness.py``): a failed job's logs outlive the benchmark's temporary
directory, and a job during which the checkout's code changed is named as such (it may have run half an edit: seen
as an overlap benchmark job whose engine refused every weight update, its files from before and after one edit)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import harness  # noqa: E402


@pytest.mark.slow
def test_failed_job_keeps_its_run_dir_and_torchrun_output(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "FAILED_RUNS", tmp_path / "failed")
    run_dir = tmp_path / "bench" / "async2"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "engine0.log").write_text("the engine's log\n")
    overrides = [
        f'logging.run_dir="{run_dir}"',
        f'actor.model_path="{tmp_path}/no_model"',  # every rank fails its config check
        f"rollout.port={harness.free_rollout_port()}",
    ]
    with pytest.raises(SystemExit) as e:
        harness.run_tiny_job(run_dir, overrides, timeout_s=300, what="the test job")
    shutil.rmtree(tmp_path / "bench")  # what the benchmark's TemporaryDirectory does on its way out
    message = str(e.value)
    assert message.startswith("the test job failed (exit 1)")
    (kept,) = (tmp_path / "failed").iterdir()
    assert message.endswith(f"its logs are kept under {kept}")
    assert (kept / "async2" / "logs" / "engine0.log").read_text() == "the engine's log\n"
    assert "actor.model_path" in (kept / "torchrun.stderr").read_text()  # both ranks' config errors, whole


def test_source_stamps_name_the_files_an_edit_touched(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "REPO", tmp_path)
    for name in ("asyncrl/cpu_engine/server.py", "asyncrl/cpu_engine/weight_updates.py", "configs/tiny.toml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    (tmp_path / "asyncrl" / "notes.txt").write_text("not code\n")
    before = harness.source_stamps()
    assert harness.changed_sources(before, harness.source_stamps()) == []
    (tmp_path / "asyncrl/cpu_engine/weight_updates.py").write_text("x = 2\n")  # same size: the mtime tells
    st = (tmp_path / "asyncrl/cpu_engine/weight_updates.py").stat()
    os.utime(tmp_path / "asyncrl/cpu_engine/weight_updates.py", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    (tmp_path / "configs/tiny.toml").unlink()
    (tmp_path / "asyncrl/cpu_engine/new.py").write_text("")
    (tmp_path / "asyncrl/notes.txt").write_text("edited, not code\n")
    assert harness.changed_sources(before, harness.source_stamps()) == [
        "asyncrl/cpu_engine/new.py",
        "asyncrl/cpu_engine/weight_updates.py",
        "configs/tiny.toml",
    ]
