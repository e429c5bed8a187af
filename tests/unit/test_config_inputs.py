"""Config validation before any process starts (issue 15): non-finite numbers, sampling bounds, seeds, and every
path and ``module:attr`` hook the run reads -- each error names the dotted key."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.validate import check_inputs
from asyncrl.runner import launcher

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"


@pytest.mark.parametrize(
    "override,key",
    [
        ("actor.lr=inf", "actor.lr"),
        ("actor.lr=nan", "actor.lr"),
        ("actor.lr=-inf", "actor.lr"),
        ("actor.lr=0.0", "actor.lr"),
        ("actor.min_lr=1.0", "actor.min_lr"),
        ("runner.seed=-1", "runner.seed"),
        ("prepare.seed=-5", "prepare.seed"),
        ('prepare.sft_matmul_dtype="float16"', "prepare.sft_matmul_dtype"),
        ("rollout.sampling.temperature=nan", "rollout.sampling.temperature"),
        ("rollout.sampling.temperature=inf", "rollout.sampling.temperature"),
        ("rollout.sampling.temperature=-0.5", "rollout.sampling.temperature"),
        ("rollout.sampling.top_p=0.0", "rollout.sampling.top_p"),
        ("rollout.sampling.top_p=1.5", "rollout.sampling.top_p"),
        ("rollout.sampling.top_k=0", "rollout.sampling.top_k"),
        ("rollout.sampling.top_k=-2", "rollout.sampling.top_k"),
        ("rollout_buffer.no_data_warning_s=inf", "rollout_buffer.no_data_warning_s"),
        ("algorithm.kl_coef=nan", "algorithm.kl_coef"),
    ],
)
def test_bad_number_is_rejected_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=f"^{key.replace('.', '[.]')}:"):
        load_config(TINY, [override])


def test_good_sampling_values_load():
    cfg = load_config(
        TINY,
        ["rollout.sampling.temperature=0.0", "rollout.sampling.top_k=1", "rollout.sampling.top_p=1.0", "runner.seed=0"],
    )
    assert cfg.rollout.sampling.top_k == 1 and cfg.runner.seed == 0


# ---------------------------------------------------------------- paths and hooks
def _inputs(tmp: Path) -> dict[str, str]:
    model = tmp / "model"
    model.mkdir()
    shape = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, vocab_size=64)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", **shape}))  # one the actor runs
    for name in ("train.jsonl", "test.jsonl", "corpus.jsonl", "eval.jsonl"):
        (tmp / name).write_text(json.dumps({"question": "q", "golden_answers": ["a"]}) + "\n")
    (tmp / "my_hooks.py").write_text("def keep(groups):\n    return groups\nNOT_CALLABLE = 3\n")
    return {
        "model": str(model),
        "train": str(tmp / "train.jsonl"),
        "test": str(tmp / "test.jsonl"),
        "corpus": str(tmp / "corpus.jsonl"),
        "eval": str(tmp / "eval.jsonl"),
    }


def _config(p: dict[str, str], *extra: str):
    return load_config(
        TINY,
        [
            "prepare.enabled=false",
            f'actor.model_path="{p["model"]}"',
            f'data.train_path="{p["train"]}"',
            f'data.test_path="{p["test"]}"',
            f'agentloop.tool.corpus_path="{p["corpus"]}"',
            *extra,
        ],
    )


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    return _inputs(tmp_path)


def test_all_inputs_present_pass(inputs):
    check_inputs(_config(inputs, 'rollout_buffer.sample_filter_path="my_hooks:keep"'))


@pytest.mark.parametrize(
    "override,key",
    [
        ('actor.model_path="/nonexistent/model"', "actor.model_path"),
        ('rollout.model_path="/nonexistent/model"', "rollout.model_path"),
        ('data.train_path="/nonexistent/train.jsonl"', "data.train_path"),
        ('data.test_path="/nonexistent/test.jsonl"', "data.test_path"),
        ('agentloop.tool.corpus_path="/nonexistent/corpus.jsonl"', "agentloop.tool.corpus_path"),
        ('eval.eval_prompt_data={ held_out = "/nonexistent/e.jsonl" }', "eval.eval_prompt_data.held_out"),
        ('rollout_buffer.sample_filter_path="no_such_module_xyz:keep"', "rollout_buffer.sample_filter_path"),
        ('rollout_buffer.sample_filter_path="my_hooks:missing"', "rollout_buffer.sample_filter_path"),
        ('rollout_buffer.sample_filter_path="my_hooks:NOT_CALLABLE"', "rollout_buffer.sample_filter_path"),
        ('rollout_buffer.dynamic_sampling_filter_path="my_hooks"', "rollout_buffer.dynamic_sampling_filter_path"),
        ('rollout_buffer.custom_data_buffer_path="my_hooks:Nope"', "rollout_buffer.custom_data_buffer_path"),
        ('logging.custom_rollout_log_function_path="my_hooks:nope"', "logging.custom_rollout_log_function_path"),
    ],
)
def test_missing_input_is_named(inputs, override, key):
    with pytest.raises(ConfigError, match=f"^{key.replace('.', '[.]')}:"):
        check_inputs(_config(inputs, override))


def test_model_dir_without_config_json_is_named(inputs, tmp_path):
    (tmp_path / "empty_model").mkdir()
    with pytest.raises(ConfigError, match="^actor.model_path: .*config.json"):
        check_inputs(_config(inputs, f'actor.model_path="{tmp_path / "empty_model"}"'))


def test_paths_made_by_preparation_are_not_required_before_it(tmp_path):
    """The embedded default: with prepare.enabled, everything under prepare.dir is produced on first run."""
    d = tmp_path / "fresh"
    inside = [
        f'prepare.dir="{d}"',
        f'actor.model_path="{d}/model_sft"',
        f'data.train_path="{d}/data/train.jsonl"',
        f'data.test_path="{d}/data/test.jsonl"',
        f'agentloop.tool.corpus_path="{d}/data/corpus.jsonl"',
    ]
    check_inputs(load_config(TINY, inside))  # nothing exists yet, nothing is required
    outside = load_config(TINY, [*inside, 'data.train_path="/nonexistent/train.jsonl"'])
    with pytest.raises(ConfigError, match="^data.train_path:"):
        check_inputs(outside)


def test_launcher_stops_before_any_process_on_a_bad_hook(inputs, tmp_path, monkeypatch, capsys):
    """``launch/train.py`` on a torchrun rank: exit 2 naming the key, before any role (broker, engine) starts."""
    monkeypatch.chdir(tmp_path)
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    started = []
    monkeypatch.setattr("asyncrl.runner.roles.run_role", lambda ctx: started.append(ctx) or 0)
    code = launcher.main(
        [
            str(TINY),
            "prepare.enabled=false",
            f'actor.model_path="{inputs["model"]}"',
            f'data.train_path="{inputs["train"]}"',
            f'data.test_path="{inputs["test"]}"',
            f'agentloop.tool.corpus_path="{inputs["corpus"]}"',
            'rollout_buffer.sample_filter_path="my_hooks:missing"',
        ]
    )
    assert code == 2 and not started
    assert "rollout_buffer.sample_filter_path" in capsys.readouterr().err
    assert os.environ["RANK"] == "0"
