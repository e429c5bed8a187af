"""``logging.wandb``: off unless given, every key typed and checked, a bad table or a missing package rejected
before any process starts, each error naming its key."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.render import render_config
from asyncrl.config.validate import check_wandb

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs/tiny.toml"


def test_off_unless_given_and_defaults_when_given():
    assert load_config(TINY).logging.wandb is None
    w = load_config(TINY, ["logging.wandb.mode=offline"]).logging.wandb
    assert (w.project, w.entity, w.mode, w.name, w.group, w.tags) == ("asyncrl", None, "offline", None, None, [])
    assert (w.init_timeout_s, w.finish_timeout_s) == (90.0, 300.0)


def test_the_table_renders_and_loads_back(tmp_path):
    table = '{ project = "p", entity = "e", mode = "offline", name = "n", group = "g", tags = ["a", "b"] }'
    cfg = load_config(TINY, [f"logging.wandb={table}"])
    text = render_config(cfg)
    assert "\n[logging.wandb]\n" in text
    (tmp_path / "resolved.toml").write_text(text)
    assert load_config(tmp_path / "resolved.toml").logging.wandb == cfg.logging.wandb


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("logging.wandb.projct=x", "logging.wandb.projct: unknown key; did you mean 'logging.wandb.project'?"),
        ("logging.wandb.dir=x", "logging.wandb.dir: unknown key"),
        ("logging.wandb.mode=cloud", "logging.wandb.mode: must be one of 'online', 'offline', 'disabled', got 'cloud'"),
        ("logging.wandb=true", "logging.wandb: expected a table or none, got True"),
        ('logging.wandb.project=" "', "logging.wandb.project: must not be empty"),
        ("logging.wandb.tags=[1]", "logging.wandb.tags[0]: expected a string"),
        ('logging.wandb.tags="a"', "logging.wandb.tags: expected a list"),
        ("logging.wandb.init_timeout_s=0", "logging.wandb.init_timeout_s: must be a finite number > 0"),
        ("logging.wandb.finish_timeout_s=-1", "logging.wandb.finish_timeout_s: must be a finite number > 0"),
    ],
)
def test_a_bad_table_is_rejected_naming_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override])
    assert str(e.value).startswith(message), str(e.value)


def test_a_missing_package_is_reported_before_any_process_starts(tmp_path):
    """A real interpreter without wandb (``-S``: no site-packages; asyncrl.config needs only the standard library, and
    tomli before Python 3.11, linked in alone), through the launcher's ``check_inputs``; ``mode = "disabled"`` needs
    no package."""
    path = [str(ROOT)]
    if sys.version_info < (3, 11):
        import tomli

        (tmp_path / "tomli").symlink_to(Path(tomli.__file__).parent)
        path.append(str(tmp_path))
    code = textwrap.dedent(
        """
        import importlib.util, sys
        from asyncrl.config import ConfigError, load_config
        from asyncrl.config.validate import check_inputs
        assert importlib.util.find_spec("wandb") is None
        check_inputs(load_config("configs/tiny.toml", ["logging.wandb.mode=disabled"]))
        try:
            check_inputs(load_config("configs/tiny.toml", ["logging.wandb.mode=offline"]))
        except ConfigError as e:
            print(e)
        """
    )
    r = subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=ROOT,
        env={"PYTHONPATH": ":".join(path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("logging.wandb: wandb is not installed: pip install asyncrl[wandb]"), r.stdout


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            'logging.wandb.project="team/project"',
            "logging.wandb.project: wandb rejects 'team/project': Invalid project",
        ),
        (f'logging.wandb.tags=["{"x" * 65}"]', "logging.wandb.tags: wandb rejects ['xxx"),
    ],
)
def test_settings_wandb_refuses_are_rejected_before_any_process_starts(override, message):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install -e '.[wandb]'; the dev extra has it)")
    cfg = load_config(TINY, ["logging.wandb.mode=offline", override])
    with pytest.raises(ConfigError) as e:
        check_wandb(cfg)
    assert str(e.value).startswith(message), str(e.value)
    check_wandb(load_config(TINY, ["logging.wandb.mode=offline", 'logging.wandb.tags=["ok"]']))  # a good one passes
