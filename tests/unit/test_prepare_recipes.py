"""The embedded default's cached stages record the recipe they were made by (``asyncrl.runner.prepare``): a later
run whose config asks for another recipe makes them again, saying which settings differ, instead of training from
artefacts its config does not describe. The stages are really made (tiny sizes: 40 countries, a 2-layer model, a
2-step warm start)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.runner import prepare as prep

ROOT = Path(__file__).resolve().parents[2]


SMALL = ["prepare.num_entities=40", "prepare.num_layers=2", "prepare.sft_steps=2", "prepare.sft_batch_size=4"]


def _cfg(d: Path, *overrides: str):
    return load_config(ROOT / "configs/tiny.toml", [f'prepare.dir="{d}"', *overrides])


def _made(d: Path) -> dict[str, str]:
    """Each stage's marker as written (its time of making and recipe)."""
    return {n: (d / n / ".done").read_text() for n in ("data", "model", "model_sft") if (d / n / ".done").is_file()}


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
    assert [r for r in caplog.records if r.name == "asyncrl.prepare"] == []
    assert all(prep.recipe_drift(tmp_path / n, r) is None for n, r in prep.recipes(cfg).items())


def test_a_warm_start_made_by_another_recipe_is_made_again_saying_what_differs(tmp_path, caplog):
    prep.prepare_if_needed(_cfg(tmp_path, *SMALL, "prepare.sft_steps=3", "prepare.sft_weight_decay=0.0"))
    before = _made(tmp_path)
    cfg = _cfg(tmp_path, *SMALL)
    with caplog.at_level(logging.WARNING, logger="asyncrl.prepare"):
        prep.prepare_if_needed(cfg)
    said = [r.getMessage() for r in caplog.records if r.name == "asyncrl.prepare"]
    assert len(said) == 1, said  # data and the random checkpoint do not depend on the warm start's settings
    assert "sft_steps 3 -> 2" in said[0] and "sft_weight_decay 0.0 -> 0.1" in said[0]
    assert f"{tmp_path / 'model_sft'} is made again" in said[0]
    after = _made(tmp_path)
    assert after["data"] == before["data"] and after["model"] == before["model"]  # kept, not made again
    assert prep.recipe_drift(tmp_path / "model_sft", prep.recipes(cfg)["model_sft"]) is None
    assert (tmp_path / "model_sft" / "config.json").is_file()


def test_other_data_makes_every_later_stage_another_recipe(tmp_path):
    _made_by(_cfg(tmp_path, "prepare.num_entities=60"), tmp_path)
    cfg = _cfg(tmp_path)
    drift = {n: prep.recipe_drift(tmp_path / n, r) for n, r in prep.recipes(cfg).items()}
    assert all(d is not None and "num_entities 60 -> 1000" in d for d in drift.values()), drift


def test_upto_the_model_leaves_a_warm_start_of_another_recipe_alone(tmp_path):
    """``tools/warm_start_curve.py`` prepares the data and the random model only: a warm start in the directory,
    whatever its recipe, is neither made nor made again."""
    prep.prepare_if_needed(_cfg(tmp_path, *SMALL))
    before = _made(tmp_path)
    out = prep.prepare_if_needed(_cfg(tmp_path, *SMALL, "prepare.sft_steps=7"), upto="model")
    assert set(out) == {"data", "model"} and _made(tmp_path) == before
    with pytest.raises(ValueError, match="no stage 'warm'"):
        prep.prepare_if_needed(_cfg(tmp_path, *SMALL), upto="warm")


def test_a_stage_made_before_recipes_were_recorded_is_made_again(tmp_path, caplog):
    cfg = _cfg(tmp_path, *SMALL)
    prep.prepare_if_needed(cfg)
    (tmp_path / "model_sft" / ".done").write_text("2026-12-04 10:00:00\n")  # the marker earlier versions wrote
    with caplog.at_level(logging.WARNING, logger="asyncrl.prepare"):
        prep.prepare_if_needed(cfg)
    said = [r.getMessage() for r in caplog.records if r.name == "asyncrl.prepare"]
    assert len(said) == 1 and "did not record its recipe" in said[0], said
    assert prep.recipe_drift(tmp_path / "model_sft", prep.recipes(cfg)["model_sft"]) is None
