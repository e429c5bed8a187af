"""Validation of the periodic eval settings (Miles' three backends and the snapshot sources)."""

from __future__ import annotations

import pytest
from test_config import check, load  # the config tests' helpers (BASE config)

from asyncrl.config import ConfigError, validate

EXTERNAL = ['eval.eval_function_path="mod:Fn"', "eval.eval_interval=4"]


def test_fleet_needs_its_devices_and_an_interval(tmp_path):  # the fleet's own rules: tests/unit/test_eval_fleet.py
    check(tmp_path, ["eval.eval_num_gpus=1", "eval.eval_interval=4"], "cluster.component_placement.eval")
    check(tmp_path, ['eval.eval_function_path="m:F"', 'eval.eval_hf_dir="d"'], "eval.eval_interval")


def test_external_needs_a_snapshot_source(tmp_path):
    msg = check(tmp_path, EXTERNAL, "eval.eval_hf_dir")
    assert "runner.save_hf" in msg


def test_reused_checkpoints_need_a_multiple_of_the_checkpoint_interval(tmp_path):
    msg = check(tmp_path, EXTERNAL + ["runner.save_hf=true", "runner.checkpoint_interval=3"], "eval.eval_interval")
    assert "runner.checkpoint_interval" in msg
    check(tmp_path, EXTERNAL + ["runner.save_hf=true"], "runner.checkpoint_interval")  # no periodic checkpoints
    validate(load(tmp_path, overrides=EXTERNAL + ["runner.save_hf=true", "runner.checkpoint_interval=2"]), world_size=4)


def test_fresh_export_is_a_valid_source_with_or_without_save_hf(tmp_path):
    for extra in ([], ["runner.save_hf=true", "runner.checkpoint_interval=3"]):
        validate(load(tmp_path, overrides=EXTERNAL + ['eval.eval_hf_dir="/dev/shm/x"', *extra]), world_size=4)


def test_external_function_path_form(tmp_path):
    check(
        tmp_path,
        ['eval.eval_function_path="no_colon"', "eval.eval_interval=4", 'eval.eval_hf_dir="d"'],
        "eval.eval_function_path",
    )


def test_shared_engines_need_something_to_evaluate(tmp_path):
    check(tmp_path, ["eval.eval_interval=2"], "eval.eval_prompt_data")
    validate(load(tmp_path, overrides=["eval.eval_interval=2", 'data.test_path="t.jsonl"']), world_size=4)
    validate(
        load(tmp_path, overrides=["eval.eval_interval=2", 'eval.eval_prompt_data={ aime = "a.jsonl" }']), world_size=4
    )


def test_shared_engines_warn_that_eval_hf_dir_is_ignored(tmp_path):
    ws = validate(
        load(tmp_path, overrides=["eval.eval_interval=2", 'data.test_path="t.jsonl"', 'eval.eval_hf_dir="/dev/shm/x"']),
        world_size=4,
    )
    assert any("eval.eval_hf_dir" in w and "ignored" in w for w in ws)


def test_field_bounds(tmp_path):
    for bad in (
        "eval.eval_max_in_flight=0",
        "eval.eval_wait_timeout_s=0",
        "eval.eval_keep_snapshots=-1",
        'eval.eval_overflow_policy="drop"',
    ):
        with pytest.raises((ConfigError, ValueError), match="eval.eval_"):
            load(tmp_path, overrides=[bad])
