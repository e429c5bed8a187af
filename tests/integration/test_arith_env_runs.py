"""configs/arith.toml runs end to end: its own preparation (arith problems, tokenizer, tiny model, a short warm start
whose demonstrations all call the calculator), then 3 RL steps under torchrun with the real calculator tool; the
environment's metrics (``env/called_calculator``, ``env/answered``) and the tool's (``tool/calculator/calls``)
reach the step records of metrics.jsonl and TensorBoard. Learning is not checked here (docs/arith_recipe.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from proc_helpers import PREPARE_OVERRIDES, REPO, assert_nothing_left, read_metrics, run_job

# Every demonstration calls the calculator and a warm start of 60 steps of 16 teaches the call's shape, so the
# sampled policy calls it from the first step (measured 2026-12-07, 2 cores at load 9: env/called_calculator
# 0.6-0.9 a step; the test took 59 s, 28 s of it preparing).
ARITH_PREPARE = ["prepare.sft_steps=60", "prepare.sft_batch_size=16", "prepare.sft_correct_fraction=1.0"]


@pytest.fixture(scope="module")
def arith_prepared(tmp_path_factory) -> Path:
    from asyncrl.config import load_config
    from asyncrl.runner.prepare import prepare_if_needed

    d = tmp_path_factory.mktemp("arith")
    prepare_if_needed(
        load_config(REPO / "configs/arith.toml", [f'prepare.dir="{d}"', *PREPARE_OVERRIDES, *ARITH_PREPARE])
    )
    return d


def tb_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every TensorBoard scalar of the run, read back from the event files: tag -> {step: value}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


@pytest.mark.slow
def test_arith_trains_three_steps_and_reports_its_metrics(arith_prepared, tmp_path):
    run_dir = tmp_path / "run"
    r = run_job(arith_prepared, run_dir, *ARITH_PREPARE, "runner.max_steps=3", config="configs/arith.toml")
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-6000:]}"
    steps = [rec for rec in read_metrics(run_dir) if "reward/mean" in rec]
    assert [rec["step"] for rec in steps] == [1, 2, 3]
    for rec in steps:
        assert 0.0 <= rec["env/called_calculator"] <= 1.0 and 0.0 <= rec["env/answered"] <= 1.0
    assert sum(rec.get("tool/calculator/calls", 0) for rec in steps) > 0, steps
    assert sum(rec["env/called_calculator"] for rec in steps) > 0
    tb = tb_scalars(run_dir)
    for tag in ("env/called_calculator", "env/answered"):
        assert sorted(tb[tag]) == [1, 2, 3], (tag, tb.get(tag))
    called = [s for s in steps if s.get("tool/calculator/calls")]
    assert all(tb["tool/calculator/calls"][s["step"]] == s["tool/calculator/calls"] for s in called)
    assert_nothing_left(run_dir, within_s=60)
