"""The dedicated eval fleet's pure parts: its size, the inheritance of the rollout engines' settings
(TP from eval_num_gpus_per_engine, the TP-tied fields, single-field overrides), placement of the
``eval`` devices and the validation errors, each naming its keys."""

from __future__ import annotations

import pytest
from test_config import check, load  # the config tests' helpers (BASE: 4 devices, actor 0-1, rollout 2-3)

from asyncrl.config import ConfigError, validate
from asyncrl.config.eval_engine import (
    eval_engine_config,
    eval_engine_settings,
    fleet_size,
    parse_flags,
    render_flags,
    resolve_eval_sglang,
)
from asyncrl.config.placement import parse_placement
from asyncrl.config.schema import EvalConfig
from asyncrl.engine.launch import sglang_command

FLEET_PLACEMENT = 'cluster.component_placement={ actor = "0", "rollout,reward" = "1-2", eval = "3" }'
FLEET = [
    FLEET_PLACEMENT,
    "eval.eval_num_gpus=1",
    "eval.eval_interval=2",
    'eval.eval_hf_dir="/dev/shm/x"',
    'data.test_path="t.jsonl"',
]


def test_fleet_size_divides():
    assert fleet_size(EvalConfig()) == 0
    assert fleet_size(EvalConfig(eval_num_gpus=4, eval_num_gpus_per_engine=2)) == 2
    with pytest.raises(ConfigError) as e:
        fleet_size(EvalConfig(eval_num_gpus=3, eval_num_gpus_per_engine=2))
    assert "eval.eval_num_gpus_per_engine" in str(e.value) and "eval.eval_num_gpus =" in str(e.value)


def test_flags_round_trip():
    args = ["--dp-size", "2", "--enable-dp-attention", "--chunked-prefill-size=512", "--no-enable-cache-report"]
    f = parse_flags(args)
    assert f == {
        "dp_size": "2",
        "enable_dp_attention": True,
        "chunked_prefill_size": "512",
        "enable_cache_report": False,
    }
    assert parse_flags(render_flags(f)) == {k: v for k, v in f.items() if v is not False}
    with pytest.raises(ConfigError, match="rollout.sglang.extra_args"):
        parse_flags(["2", "--x"])


ROLLOUT = {
    "mem_fraction_static": "0.8",
    "dp_size": "2",
    "pp_size": "2",
    "ep_size": "4",
    "attn_cp_size": "2",
    "enable_dp_attention": True,
    "chunked_prefill_size": "512",
}


def test_same_tp_inherits_everything():
    s = resolve_eval_sglang(ROLLOUT, rollout_tp=2, eval_tp=2, overrides={})
    assert s == {**ROLLOUT, "tp_size": "2"}


def test_different_tp_resets_the_tp_tied_fields_to_one():
    s = resolve_eval_sglang(ROLLOUT, rollout_tp=2, eval_tp=1, overrides={})
    assert s["tp_size"] == "1"
    assert all(s[k] == "1" for k in ("dp_size", "pp_size", "ep_size", "attn_cp_size"))
    assert s["enable_dp_attention"] is True and s["chunked_prefill_size"] == "512"  # the rest is inherited
    # an explicit override wins over the reset; a boolean is turned off by "false" or the no_ form
    s = resolve_eval_sglang(
        ROLLOUT,
        rollout_tp=2,
        eval_tp=4,
        overrides={"dp_size": "2", "mem_fraction_static": "0.9", "enable_dp_attention": "false"},
    )
    assert s["dp_size"] == "2" and s["pp_size"] == "1" and s["mem_fraction_static"] == "0.9"
    assert s["enable_dp_attention"] is False and "--enable-dp-attention" not in render_flags(s)
    s = resolve_eval_sglang(ROLLOUT, rollout_tp=2, eval_tp=2, overrides={"no_enable_dp_attention": "true"})
    assert s["enable_dp_attention"] is False


def test_tp_cannot_be_overridden_in_eval_sglang():
    with pytest.raises(ConfigError, match="eval.eval_num_gpus_per_engine"):
        resolve_eval_sglang(ROLLOUT, rollout_tp=1, eval_tp=1, overrides={"tp_size": "2"})


def test_eval_engine_config_feeds_the_command_builders(tmp_path):
    cfg = load(
        tmp_path,
        overrides=[
            "rollout.tensor_parallel_size=2",
            'rollout.sglang.extra_args=["--dp-size", "2", "--enable-metrics"]',
            'cluster.component_placement={ actor = "0-1", "rollout,reward" = "2-3", eval = "4" }',
            "eval.eval_num_gpus=1",
            'eval.eval_sglang={ mem_fraction_static = "0.9", max_running_requests = "7" }',
        ],
    )
    s = eval_engine_settings(cfg)
    assert s["tp_size"] == "1" and s["dp_size"] == "1" and s["enable_metrics"] is True
    ecfg = eval_engine_config(cfg)
    assert ecfg.rollout.tensor_parallel_size == 1 and ecfg.rollout.max_running_requests == 7
    assert ecfg.rollout.sglang.mem_fraction_static == 0.9
    cmd = sglang_command(ecfg, port=1234, base_gpu_id=4)
    assert cmd[cmd.index("--tp-size") + 1] == "1" and cmd[cmd.index("--mem-fraction-static") + 1] == "0.9"
    assert "2" not in [cmd[i + 1] for i, a in enumerate(cmd) if a == "--dp-size"]
    assert cfg.rollout.tensor_parallel_size == 2  # the rollout's own settings are untouched


def test_placement_eval_ranks_and_engines():
    p = parse_placement({"actor": "0", "rollout,reward": "1", "eval": "2-5"}, world_size=6, engine_tp=1)
    assert p.eval_ranks == (2, 3, 4, 5) and [p.role_of(r) for r in range(3)] == ["actor", "rollout", "eval"]
    assert p.eval_engines(2) == ((2, 3), (4, 5))
    with pytest.raises(ConfigError, match="eval.eval_num_gpus_per_engine"):
        p.eval_engines(3)


def test_a_valid_fleet_config(tmp_path):
    validate(load(tmp_path, overrides=FLEET), world_size=4)
    validate(
        load(
            tmp_path,
            overrides=[*FLEET[:3], 'data.test_path="t.jsonl"', "runner.save_hf=true", "runner.checkpoint_interval=2"],
        ),
        world_size=4,
    )


def test_fleet_validation_errors_name_their_keys(tmp_path):
    msg = check(tmp_path, [*FLEET, "eval.eval_num_gpus=2"], "cluster.component_placement.eval")
    assert "eval.eval_num_gpus" in msg
    msg = check(tmp_path, [*FLEET, "eval.eval_num_gpus=0"], "cluster.component_placement.eval")
    assert "eval.eval_num_gpus = 0" in msg
    msg = check(tmp_path, [*FLEET, "eval.eval_num_gpus_per_engine=2"], "eval.eval_num_gpus_per_engine")
    assert "eval.eval_num_gpus" in msg
    check(tmp_path, [*FLEET, 'eval.eval_function_path="m:F"'], "eval.eval_function_path")
    msg = check(tmp_path, [f for f in FLEET if "eval_hf_dir" not in f], "eval.eval_hf_dir")
    assert "fleet" in msg and "runner.save_hf" in msg
    check(tmp_path, [f for f in FLEET if "eval_interval" not in f], "eval.eval_interval")
    check(tmp_path, [*FLEET, 'eval.eval_sglang={ tp_size = "2" }'], "eval.eval_num_gpus_per_engine")
    check(tmp_path, [*FLEET[:4]], "eval.eval_prompt_data")  # nothing to evaluate
