"""Config: loading, types, derived defaults, overrides, and every validation rule (each names its key)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config, validate
from asyncrl.config.derive import default_max_inflight_groups

ROOT = Path(__file__).resolve().parents[2]

BASE = """
[runner]
async_mode = true
[cluster]
num_nodes = 1
num_devices_per_node = 4
component_placement = { actor = "0-1", "rollout,reward" = "2-3" }
[rollout]
rollout_backend = "cpu"
max_running_requests = 10
[agentloop]
task_name = "searchr1"
[agentloop.tool]
corpus_path = "corpus.jsonl"
[data]
rollout_batch_size = 4
[algorithm]
group_size = 2
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(textwrap.dedent(text))
    return p


def load(tmp_path, text=BASE, overrides=()):
    return load_config(write(tmp_path, text), list(overrides))


def check(tmp_path, overrides, key, *, text=BASE, world=None):
    """Load + validate with overrides; assert the ConfigError names ``key``."""
    with pytest.raises(ConfigError) as e:
        cfg = load(tmp_path, text, overrides)
        validate(cfg, world_size=world or 4)
    assert key in str(e.value), str(e.value)
    return str(e.value)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_validates(path):
    cfg = load_config(path)
    validate(cfg)  # must not raise


def test_searchr1_derived_values_follow_the_seeds():
    cfg = load_config(ROOT / "configs/searchr1.toml")
    rb = cfg.rollout_buffer
    assert rb.max_buffered_groups == 1024  # 2 x 512
    assert rb.max_dropped_groups_per_step == 5120  # 10 x 512
    # ceil(max_running_requests x instances x 1.2 / group_size) with 8 rollout GPUs at TP 1
    assert rb.max_inflight_groups == math.ceil(128 * 8 * 1.2 / 4) == 308
    assert rb.submission_granularity == "group"  # RLinf's group counting: no Miles setting asks for samples
    assert {"rollout_buffer.max_inflight_groups", "rollout_buffer.max_buffered_groups"} <= cfg.derived


def test_user_values_are_not_marked_derived(tmp_path):
    cfg = load(tmp_path, overrides=["rollout_buffer.max_buffered_groups=12"])
    assert cfg.rollout_buffer.max_buffered_groups == 12
    assert "rollout_buffer.max_buffered_groups" not in cfg.derived


def test_inflight_default_counts_engines_and_tp(tmp_path):
    cfg = load(tmp_path, overrides=["rollout.tensor_parallel_size=2"])
    # 2 rollout devices at TP 2 -> 1 instance: ceil(10 * 1 * 1.2 / 2) = 6
    assert cfg.rollout_buffer.max_inflight_groups == 6
    assert default_max_inflight_groups(max_running_requests=10, instances=2, group_size=2) == 12


def test_max_concurrent_samples_sets_inflight_in_groups(tmp_path):
    cfg = load(tmp_path, overrides=["rollout_buffer.max_concurrent_samples=9"])
    assert cfg.rollout_buffer.max_inflight_groups == 4  # 9 // group_size 2


def test_overrides_take_toml_literals(tmp_path):
    cfg = load(
        tmp_path,
        overrides=[
            "runner.max_steps=7",
            "rollout.sampling.temperature=0.5",
            "rollout.pause_mode=in_place",
            'logging.run_dir="runs/x"',
        ],
    )
    assert cfg.runner.max_steps == 7
    assert cfg.rollout.sampling.temperature == 0.5
    assert cfg.rollout.pause_mode == "in_place"
    assert cfg.logging.run_dir == "runs/x"


def test_sync_mode_defaults_to_group_granularity(tmp_path):
    cfg = load(tmp_path, overrides=["runner.async_mode=false"])
    assert cfg.rollout_buffer.submission_granularity == "group"


def test_config_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, asyncrl.config; from asyncrl.config import load_config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


# ---- validation rules: each must name its key -------------------------------------------------


def test_async_rejects_shared_devices(tmp_path):
    msg = check(
        tmp_path,
        ['cluster.component_placement={ actor = "0-2", "rollout,reward" = "2-3" }'],
        "cluster.component_placement",
    )
    assert "separate" in msg


def test_async_rejects_non_server_backend(tmp_path):
    check(
        tmp_path,
        ['rollout.rollout_backend="sglang"', 'rollout.sglang.backend_type="engine"'],
        "rollout.sglang.backend_type",
    )


def test_async_requires_task_name(tmp_path):
    text = BASE.replace('task_name = "searchr1"', "")
    check(tmp_path, [], "agentloop.task_name", text=text)


def test_pause_mode_must_be_known(tmp_path):
    msg = check(tmp_path, ['rollout.pause_mode="freeze"'], "rollout.pause_mode")
    assert "retract" in msg


def test_abort_pause_mode_rejected_in_async(tmp_path):
    msg = check(tmp_path, ['rollout.pause_mode="abort"'], "rollout.pause_mode")
    assert "async" in msg


def test_abort_pause_mode_allowed_in_sync(tmp_path):
    cfg = load(tmp_path, overrides=['rollout.pause_mode="abort"', "runner.async_mode=false"])
    validate(cfg, world_size=4)


def test_overlapping_placement(tmp_path):
    check(
        tmp_path,
        ["runner.async_mode=false", 'cluster.component_placement={ actor = "0-2", rollout = "2-3", reward = "3" }'],
        "cluster.component_placement",
    )


def test_out_of_range_placement(tmp_path):
    msg = check(
        tmp_path,
        ['cluster.component_placement={ actor = "0-1", "rollout,reward" = "2-4" }'],
        "cluster.component_placement",
    )
    assert "out of range" in msg


def test_placement_must_cover_world(tmp_path):
    msg = check(
        tmp_path,
        ['cluster.component_placement={ actor = "0", "rollout,reward" = "2-3" }'],
        "cluster.component_placement",
    )
    assert "[1]" in msg


def test_placement_needs_reward(tmp_path):
    msg = check(
        tmp_path, ['cluster.component_placement={ actor = "0-1", rollout = "2-3" }'], "cluster.component_placement"
    )
    assert "reward" in msg


def test_unparsable_placement(tmp_path):
    check(
        tmp_path,
        ['cluster.component_placement={ actor = "zero", "rollout,reward" = "2-3" }'],
        "cluster.component_placement.actor",
    )


def test_unknown_key_suggests(tmp_path):
    msg = check(tmp_path, ["rollout_buffer.max_inflight_group=3"], "rollout_buffer.max_inflight_group")
    assert "did you mean 'rollout_buffer.max_inflight_groups'" in msg


def test_unknown_section_suggests(tmp_path):
    msg = check(tmp_path, ['rolout.pause_mode="retract"'], "rolout")
    assert "did you mean 'rollout'" in msg


@pytest.mark.parametrize(
    "override,key",
    [
        ('data.rollout_batch_size="big"', "data.rollout_batch_size"),
        ("runner.async_mode=1", "runner.async_mode"),
        ("rollout.max_running_requests=2.5", "rollout.max_running_requests"),
        ("algorithm.group_size=true", "algorithm.group_size"),
    ],
)
def test_wrong_types(tmp_path, override, key):
    check(tmp_path, [override], key)


@pytest.mark.parametrize(
    "override,key",
    [
        ("data.rollout_batch_size=0", "data.rollout_batch_size"),
        ("algorithm.group_size=-1", "algorithm.group_size"),
        ("rollout.max_running_requests=0", "rollout.max_running_requests"),
        ("rollout_buffer.max_inflight_groups=0", "rollout_buffer.max_inflight_groups"),
        ("rollout_buffer.max_buffered_groups=-3", "rollout_buffer.max_buffered_groups"),
        ("sync.bucket_bytes=0", "sync.bucket_bytes"),
    ],
)
def test_non_positive_sizes(tmp_path, override, key):
    check(tmp_path, [override], key)


def test_buffer_below_batch_is_an_error(tmp_path):
    check(tmp_path, ["rollout_buffer.max_buffered_groups=3"], "rollout_buffer.max_buffered_groups")


def test_actor_parallel_sizes_divide_devices(tmp_path):
    check(tmp_path, ["actor.tensor_model_parallel_size=4"], "actor.tensor_model_parallel_size")


def test_engine_tp_divides_rollout_devices(tmp_path):
    check(tmp_path, ["rollout.tensor_parallel_size=3"], "rollout.tensor_parallel_size")


def test_http_retriever_needs_url_when_the_environment_searches(tmp_path):
    """Checked with the environment (check_agent: the dry run and the launcher), which knows whether it searches."""
    from asyncrl.agent.envs import check_agent

    cfg = load(tmp_path, BASE, ['agentloop.tool.retriever="http"', 'agentloop.task_name="searchr1"'])
    with pytest.raises(ConfigError, match="agentloop.tool.retriever_url: required"):
        check_agent(cfg)
    check_agent(load(tmp_path, BASE, ['agentloop.tool.retriever="http"', 'agentloop.task_name="arith"']))


def test_eval_backends_are_exclusive(tmp_path):
    check(
        tmp_path,
        ["eval.eval_num_gpus=1", 'eval.eval_function_path="m:F"', "eval.eval_interval=5"],
        "eval.eval_function_path",
    )


# ---- warnings ---------------------------------------------------------------------------------


def test_warning_staleness_cap_below_buffer_bound(tmp_path):
    ws = validate(load(tmp_path, overrides=["agentloop.max_actor_accept_staleness=1"]), world_size=4)
    assert any("agentloop.max_actor_accept_staleness" in w for w in ws)


def test_no_staleness_warning_at_the_bound(tmp_path):
    ws = validate(load(tmp_path, overrides=["agentloop.max_actor_accept_staleness=2"]), world_size=4)
    assert not any("max_actor_accept_staleness" in w for w in ws)


def test_warning_buffer_below_inflight_plus_batch(tmp_path):
    ws = validate(load(tmp_path, overrides=["rollout_buffer.max_inflight_groups=6"]), world_size=4)
    assert any("max_inflight_groups" in w and "max_buffered_groups" in w for w in ws)


def test_warning_buffer_below_two_batches(tmp_path):
    ws = validate(
        load(tmp_path, overrides=["rollout_buffer.max_buffered_groups=5", "rollout_buffer.max_inflight_groups=1"]),
        world_size=4,
    )
    assert any("2 x rollout_batch_size" in w for w in ws)


@pytest.mark.parametrize(
    "extra,warned",
    [
        ('["--tokenizer-worker-num", "4"]', True),
        ('["--tokenizer-worker-num=2"]', True),
        ('["--tokenizer-worker-num", "1"]', False),
        ("[]", False),
    ],
)
def test_warning_sglang_tokenizer_workers_skip_the_api_key(tmp_path, extra, warned):
    ws = validate(
        load(tmp_path, overrides=['rollout.rollout_backend="sglang"', f"rollout.sglang.extra_args={extra}"]),
        world_size=4,
    )
    assert any("--tokenizer-worker-num" in w and "--api-key" in w for w in ws) is warned, ws


def test_defaults_give_no_buffer_warnings(tmp_path):
    ws = validate(load(tmp_path, overrides=["rollout_buffer.max_inflight_groups=4"]), world_size=4)
    assert ws == []


# ---- seed parity (issue 17) -----------------------------------------------------------------------


def test_colocated_placement_is_rejected_with_the_reason(tmp_path):
    text = BASE.replace("async_mode = true", "async_mode = false").replace(
        'component_placement = { actor = "0-1", "rollout,reward" = "2-3" }',
        'component_placement = { "actor,rollout,reward" = "0-3" }',
    )
    msg = check(tmp_path, [], "cluster.component_placement", text=text)
    assert "colocated placement is not supported" in msg and "[0, 1, 2, 3]" in msg and "no engine" in msg


@pytest.mark.parametrize("factor,B,expected", [(None, 4, 8), (2.0, 4, 8), (1.5, 3, 4), (3.7, 2, 7)])
def test_capacity_factor_sets_the_buffer_limit(tmp_path, factor, B, expected):
    from asyncrl.config.derive import explain

    ov = [f"data.rollout_batch_size={B}"] + (
        [] if factor is None else [f"rollout_buffer.async_data_buffer_capacity_factor={factor}"]
    )
    cfg = load(tmp_path, overrides=ov)
    validate(cfg, world_size=4)
    assert cfg.rollout_buffer.max_buffered_groups == expected  # floor(factor x B)
    assert "rollout_buffer.max_buffered_groups" in cfg.derived
    shown = "\n".join(explain(cfg))
    assert (
        f"max_buffered_groups = floor({2.0 if factor is None else factor:g} x rollout_batch_size {B}) = {expected}"
        in shown
    )


def test_capacity_factor_and_max_buffered_groups_together_are_an_error(tmp_path):
    msg = check(
        tmp_path,
        ["rollout_buffer.async_data_buffer_capacity_factor=2.0", "rollout_buffer.max_buffered_groups=8"],
        "rollout_buffer.async_data_buffer_capacity_factor",
    )
    assert "set only one" in msg


def test_dry_run_says_which_counting_is_in_force(tmp_path):
    """RLinf's group counting by default; Miles' trajectory counting when a Miles user sets max_concurrent_samples
    (derived) or asks for ``sample``; the line names the bound in force."""
    from asyncrl.config.derive import explain

    def line(*overrides):
        cfg = load(tmp_path, overrides=list(overrides))
        return next(x for x in explain(cfg) if "submission_granularity" in x)

    default = line("rollout_buffer.max_inflight_groups=77")
    assert '"group" (derived: RLinf\'s default): the in-flight limit counts groups' in default, default
    assert "at most max_inflight_groups = 77 groups in flight" in default, default
    miles = line("rollout_buffer.max_concurrent_samples=12")
    assert '"sample" (derived: max_concurrent_samples is set in async mode' in miles, miles
    assert "counts trajectories" in miles and "max_concurrent_samples = 12 trajectories" in miles, miles
    asked = line('rollout_buffer.submission_granularity="sample"', "rollout_buffer.max_inflight_groups=5")
    assert '"sample" (set)' in asked and "at most max_inflight_groups = 5 x group_size = " in asked, asked


@pytest.mark.parametrize("granularity", ["sample", "group"])
def test_dry_run_explains_an_auto_in_flight_limit_with_its_start(tmp_path, granularity):
    """``max_inflight_groups = "auto"`` is a word, not a number: the dry run named the budget as "auto" repeated
    group_size times ("autoautoautoauto"); it says the broker tunes it and where it starts."""
    from asyncrl.config.derive import explain, inflight_start

    cfg = load(
        tmp_path,
        overrides=[
            'rollout_buffer.max_inflight_groups="auto"',
            f'rollout_buffer.submission_granularity="{granularity}"',
        ],
    )
    line = next(x for x in explain(cfg) if "submission_granularity" in x)
    start = inflight_start(cfg)
    assert "autoauto" not in line, line
    assert f"max_inflight_groups = auto (tuned by the broker, starting at {start})" in line, line
    if granularity == "sample":
        gs = cfg.algorithm.group_size
        assert f"starting at {start} x {gs} = {start * gs}" in line and "counts trajectories" in line, line


MILES_PAGE_FLAGS = [  # every flag named on Miles' fully-async page
    "fully-async",
    "rollout-batch-size",
    "async-max-concurrent-samples",
    "rollout-submission-granularity",
    "n-samples-per-prompt",
    "update-weights-interval",
    "pause-generation-mode",
    "async-data-buffer-capacity-factor",
    "max-weight-staleness",
    "async-unused-samples-handler",
    "custom-async-data-buffer-path",
    "dynamic-sampling-filter-path",
    "rollout-sample-filter-path",
    "eval-num-gpus",
    "eval-function-path",
    "eval-interval",
    "eval-hf-dir",
    "eval-prompt-data",
    "eval-sglang-mem-fraction-static",
    "no-eval-sglang-enable-dp-attention",
    "eval-num-gpus-per-engine",
    "save-hf",
    "eval-overflow-policy",
    "eval-keep-snapshots",
    "eval-max-in-flight",
    "sglang-mem-fraction-static",
    "custom-rollout-log-function-path",
    "custom-eval-rollout-log-function-path",
    "eval-backend",
]


@pytest.mark.parametrize("flag", MILES_PAGE_FLAGS)
def test_every_miles_flag_is_answered_with_the_projects_key(tmp_path, flag):
    from asyncrl.config.seeds import project_key

    key = project_key(flag)
    assert key is not None
    for spelling in (flag.replace("-", "_"), flag):  # as a config key, with or without dashes, at the top level
        msg = check(tmp_path, [f"{spelling}=1"], spelling)
        assert f"did you mean '{key}'?" in msg and f"Miles' --{flag}" in msg
    doc = (ROOT / "docs/seed_mapping.md").read_text()
    assert f"`--{flag.removeprefix('no-').split('-sglang-')[0]}" in doc  # the mapping table has its row


def test_a_miles_flag_inside_a_section_is_answered_not_guessed(tmp_path):
    msg = check(tmp_path, ["rollout_buffer.max_weight_staleness=1"], "rollout_buffer.max_weight_staleness")
    assert "did you mean 'agentloop.max_actor_accept_staleness'?" in msg
    msg = check(tmp_path, ['rollout_buffer.rollout_submission_granularity="group"'], "rollout_submission")
    assert "did you mean 'rollout_buffer.submission_granularity'?" in msg


def test_sglang_engine_backend_is_rejected_in_sync_mode_too(tmp_path):
    check(
        tmp_path,
        ["runner.async_mode=false", 'rollout.rollout_backend="sglang"', 'rollout.sglang.backend_type="engine"'],
        "rollout.sglang.backend_type",
    )


def test_overrides_may_follow_the_flags_and_the_simulator_names_itself():
    """``launch/train.py CONFIG --dry-run key=value`` was refused ("unrecognized arguments"); ``python -m
    asyncrl.simulate --help`` said ``usage: __main__.py``."""
    from asyncrl.runner.launcher import parse_args
    from asyncrl.simulate.cli import _parser

    a = parse_args(["configs/tiny.toml", "--dry-run", "runner.max_steps=3", "data.rollout_batch_size=2"])
    b = parse_args(["configs/tiny.toml", "runner.max_steps=3", "--dry-run", "data.rollout_batch_size=2"])
    assert vars(a) == vars(b) and a.dry_run
    assert a.overrides == ["runner.max_steps=3", "data.rollout_batch_size=2"]
    assert _parser().format_usage().startswith("usage: python -m asyncrl.simulate")
