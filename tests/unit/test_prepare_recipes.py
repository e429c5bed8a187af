"""The embedded default's cached stages record the recipe they were made by (``asyncrl.runner.prepare``): a later
run whose config asks for another recipe is told which settings differ and what to delete, instead of silently
training from artefacts its config does not describe."""

from __future__ import annotations

import logging
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.runner import prepare as prep

ROOT = Path(__file__).resolve().parents[2]


def _cfg(d: Path, *overrides: str):
    return load_config(ROOT / "configs/tiny.toml", [f'prepare.dir="{d}"', *overrides])


def _made_by(cfg, d: Path) -> None:
    """Every stage marked done as made by ``cfg`` (nothing left for ``prepare_if_needed`` to make)."""
    for name, recipe in prep.recipes(cfg).items():
        (d / name).mkdir(parents=True, exist_ok=True)
        prep._mark(d / name, recipe)


def test_a_stage_made_by_the_same_recipe_is_used_without_a_word(tmp_path, caplog):
    cfg = _cfg(tmp_path)
    _made_by(cfg, tmp_path)
    with caplog.at_level(logging.WARNING, logger="asyncrl.prepare"):
        out = prep.prepare_if_needed(cfg)
    assert out["model_sft"] == tmp_path / "model_sft"
    assert caplog.records == []
    assert all(prep.recipe_drift(tmp_path / n, r) is None for n, r in prep.recipes(cfg).items())


def test_a_warm_start_made_by_another_recipe_is_named_with_what_differs(tmp_path, caplog):
    _made_by(_cfg(tmp_path, "prepare.sft_steps=1500", "prepare.sft_weight_decay=0.0"), tmp_path)
    with caplog.at_level(logging.WARNING, logger="asyncrl.prepare"):
        prep.prepare_if_needed(_cfg(tmp_path))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said  # data and the random checkpoint do not depend on the warm start's settings
    assert "sft_steps 1500 -> 1000" in said[0] and "sft_weight_decay 0.0 -> 0.1" in said[0]
    assert f"delete {tmp_path / 'model_sft'}" in said[0]


def test_other_data_makes_every_later_stage_another_recipe(tmp_path):
    _made_by(_cfg(tmp_path, "prepare.num_entities=60"), tmp_path)
    cfg = _cfg(tmp_path)
    drift = {n: prep.recipe_drift(tmp_path / n, r) for n, r in prep.recipes(cfg).items()}
    assert all(d is not None and "num_entities 60 -> 1000" in d for d in drift.values()), drift


def test_a_stage_made_before_recipes_were_recorded_is_said_to_be_of_unknown_recipe(tmp_path, caplog):
    cfg = _cfg(tmp_path)
    _made_by(cfg, tmp_path)
    (tmp_path / "model_sft" / ".done").write_text("2026-12-04 10:00:00\n")  # the marker earlier versions wrote
    with caplog.at_level(logging.WARNING, logger="asyncrl.prepare"):
        prep.prepare_if_needed(cfg)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "did not record its recipe" in said[0], said
