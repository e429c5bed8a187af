"""Session fixtures of the integration tests.

``prepared``: the embedded default's artefacts (``configs/tiny.toml``: synthetic data, tokenizer, tiny Qwen2,
warm start; ``asyncrl.runner.prepare``) made ONCE per test session into a temporary directory and shared, read
only, by every test that starts a job of the default (``proc_helpers.run_job`` / ``TinyJob``). A test that
writes into the artefacts asks for ``prepared_copy`` (its own copy of the 9 MB; preparing takes ~8 CPU-seconds).
The shared directory is fingerprinted when made and checked at the end of the session: a test that wrote into it
is reported there.

The tests that use it check plumbing, supervision and accounting, not learning, so the warm start is
``PREPARE_OVERRIDES``' two small steps (the same code as the default's 1000 steps). Measured: the jobs behave
as with the 10-step warm start these modules each made before (~33 CPU-seconds each): rewards 0, 3 turns and
~68 generated tokens a trajectory, no tool call. test_actor_learning.py checks learning on its own model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from proc_helpers import PREPARE_OVERRIDES  # every job passes them too: their recipe matches

ROOT = Path(__file__).resolve().parents[2]


def _fingerprint(d: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """Directory with ``data/``, ``model/`` and ``model_sft/`` of ``configs/tiny.toml`` at test size. Read only."""
    from asyncrl.config import load_config
    from asyncrl.runner.prepare import prepare_if_needed

    d = tmp_path_factory.mktemp("tiny")
    prepare_if_needed(load_config(ROOT / "configs/tiny.toml", [f'prepare.dir="{d}"', *PREPARE_OVERRIDES]))
    before = _fingerprint(d)
    yield d
    after = _fingerprint(d)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"a test wrote into the shared prepared artefacts (use prepared_copy): {changed}"


@pytest.fixture
def prepared_copy(prepared, tmp_path):
    """This test's own copy of ``prepared`` (for a test that writes into the artefacts)."""
    return Path(shutil.copytree(prepared, tmp_path / "prepared"))
