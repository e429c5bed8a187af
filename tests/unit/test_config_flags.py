"""Options written as flags (``launch/train.py CONFIG --max-weight-staleness=2``, the Miles habit) got argparse's
bare "unrecognized arguments"; each is answered with the ``key=value`` override it means, and that override loads."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.config.flags import flag_answer, unknown_flags
from asyncrl.config.seeds import MILES_FLAGS, project_key
from asyncrl.runner.launcher import parse_args

TINY = str(Path(__file__).resolve().parents[2] / "configs/tiny.toml")


def refused(capsys, *argv: str) -> list[str]:
    """The answer lines of ``launch/train.py argv`` (it must exit 2 before loading anything)."""
    with pytest.raises(SystemExit) as e:
        parse_args(list(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "settings are key.sub=value overrides after the TOML, not flags:" in err, err
    return [line.strip() for line in err.splitlines() if line.startswith("  ")]


def override_of(line: str) -> str:
    """The override an answer line suggests, as the shell hands it to the launcher."""
    return shlex.split(line.split("write it as ", 1)[1].split(" (Miles'")[0])[0]


def test_a_miles_flag_is_answered_with_the_override_it_means(capsys):
    (line,) = refused(capsys, TINY, "--max-weight-staleness=2", "--dry-run")
    assert line.startswith("--max-weight-staleness: write it as agentloop.max_actor_accept_staleness=2 "), line
    assert "Miles' --max-weight-staleness; docs/seed_mapping.md" in line
    # the value as the next argument, the TOML after the flag, several flags: one line each
    lines = refused(capsys, "--max-weight-staleness", "3", TINY, "--fully-async", "runner.max_steps=2")
    assert [override_of(x) for x in lines] == ["agentloop.max_actor_accept_staleness=3", "runner.async_mode=true"]
    cfg = load_config(TINY, [override_of(x) for x in lines])
    assert cfg.agentloop.max_actor_accept_staleness == 3 and cfg.runner.async_mode


@pytest.mark.parametrize("name", sorted(MILES_FLAGS))
def test_every_miles_flag_written_as_a_flag_names_its_key(capsys, name):
    flag = "--" + name.replace("_", "-")
    (line,) = refused(capsys, TINY, f"{flag}=1")
    assert line.startswith(f"{flag}: ") and project_key(name) in line, line


@pytest.mark.parametrize(
    "argv,override,check",
    [
        (["--sglang-mem-fraction-static", "0.7"], "rollout.sglang.mem_fraction_static=0.7", None),
        (["--eval-sglang-mem-fraction-static=0.5"], 'eval.eval_sglang.mem_fraction_static="0.5"', "0.5"),
        (["--no-eval-sglang-enable-dp-attention"], 'eval.eval_sglang.enable_dp_attention="false"', "false"),
        (["--pause-generation-mode", "drain"], "rollout.pause_mode=drain", None),
        (["--save-hf"], "runner.save_hf=true", None),
        (["--runner.max-steps", "7"], "runner.max_steps=7", None),  # a project key with dashes
        (["--max-steps=7"], "runner.max_steps=7", None),  # ... or without its section
    ],
)
def test_the_suggested_override_loads(capsys, argv, override, check):
    (line,) = refused(capsys, TINY, *argv)
    assert override_of(line) == override, line
    cfg = load_config(TINY, [override])
    if check is not None:  # eval_sglang's values are strings: the answer quotes them for TOML and the shell
        assert next(iter(cfg.eval.eval_sglang.values())) == check


def test_a_key_of_several_sections_and_an_unknown_flag(capsys):
    (line,) = refused(capsys, TINY, "--seed", "3")
    assert line == "--seed: write it as runner.seed=3 or prepare.seed=3"
    (line,) = refused(capsys, TINY, "--max-stepz=3")
    assert "not an option (the options are --dry-run and --help); did you mean 'runner.max_steps'" in line
    assert flag_answer("--eval-prompt-data", "aime") == (
        '--eval-prompt-data: write it as eval.eval_prompt_data={ NAME = "PATH" } '
        "(Miles' --eval-prompt-data; docs/seed_mapping.md)"
    )


def test_the_real_options_and_overrides_are_untouched():
    known = ["-h", "--help", "--dry-run"]
    assert unknown_flags([TINY, "--dry", "runner.max_steps=-1", "actor.lr=-1e-4"], known) == []
    assert unknown_flags([TINY, "--dry-run", "--x", "a.b=1", "--y", "c.toml", "--z", "-3"], known) == [
        ("--x", None),
        ("--y", None),
        ("--z", None),
    ]
    assert parse_args([TINY, "--dry", "runner.max_steps=3"]).dry_run
