"""Miles' custom logging hooks: called with the step's data in Miles' signatures; True skips the default logging."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.broker.types import Group, PromptItem, Trajectory
from asyncrl.config import load_config
from asyncrl.trainer.log_hooks import LogHooks

ROOT = Path(__file__).resolve().parents[2]
CALLS: list[tuple] = []
RETURN = {"value": False}


def log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    CALLS.append(("rollout", rollout_id, args, samples, rollout_extra_metrics, rollout_time))
    return RETURN["value"]


def log_eval_rollout_data(rollout_id, args, data, extra_metrics):
    CALLS.append(("eval", rollout_id, args, data, extra_metrics))
    return RETURN["value"]


def _cfg():
    return load_config(
        ROOT / "configs/tiny.toml",
        [
            f'logging.custom_rollout_log_function_path="{__name__}:log_rollout_data"',
            f'logging.custom_eval_rollout_log_function_path="{__name__}:log_eval_rollout_data"',
        ],
    )


def _groups():
    t = [Trajectory([1, 2], [3], [1], [-0.1], reward=float(i)) for i in range(4)]
    return [Group(0, PromptItem(0, "q0"), 0, t[:2], 0), Group(1, PromptItem(1, "q1"), 0, t[2:], 0)]


@pytest.mark.parametrize("skip", [False, True])
def test_hooks_get_the_steps_data_and_true_skips_the_default_logging(skip):
    CALLS.clear()
    RETURN["value"] = skip
    cfg = _cfg()
    hooks = LogHooks(cfg)
    groups = _groups()
    m = {
        "rollout/data_staleness/mean": 1.0,
        "time/wait_data": 2.5,
        "actor/loss": 0.1,
        "eval/test/accuracy": 0.5,
        "eval/time_seconds": 3.0,
    }
    out = hooks.step(7, groups, dict(m))
    kind, step, args, samples, extra, t = CALLS[0]
    assert (kind, step, args, t) == ("rollout", 7, cfg, 2.5)
    assert samples == [t for g in groups for t in g.trajectories] and extra == {"rollout/data_staleness/mean": 1.0}
    assert CALLS[1] == (
        "eval",
        7,
        cfg,
        {"test": {"accuracy": 0.5}},
        {"eval/test/accuracy": 0.5, "eval/time_seconds": 3.0},
    )
    if skip:
        assert out == {"time/wait_data": 2.5, "actor/loss": 0.1}
    else:
        assert out == m


def test_no_hooks_log_everything_and_a_bad_path_names_the_key():
    cfg = load_config(ROOT / "configs/tiny.toml")
    m = {"rollout/x": 1.0, "eval/y": 2.0}
    assert LogHooks(cfg).step(1, [], dict(m)) == m
    bad = load_config(ROOT / "configs/tiny.toml", ['logging.custom_rollout_log_function_path="nope_mod_x:f"'])
    with pytest.raises(ValueError, match="logging.custom_rollout_log_function_path"):
        LogHooks(bad)
