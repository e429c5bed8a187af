"""Environments, tools and rewards by name: what loads, and what fails the dry run (rc 2, the key named) before
anything starts."""

import textwrap

import pytest

from asyncrl.agent.envs import check_agent, get_env, load_reward
from asyncrl.config import load_config
from asyncrl.runner.launcher import main

USER_ENV = """
from asyncrl.agent.envs import Environment, Score, TagFormat

class Upper(Environment):
    name = "upper"
    tools = ("calculator",)
    format = TagFormat(calls={"calc": ("calculator", "expression")})
    def prompt(self, item, *, tools, chat_template=False, tokenizer=None):
        return item.prompt
    def score(self, item, text):
        return Score(1.0, {"len": len(text)})

ENV = Upper()
NOT_AN_ENV = 3

def reward(item, text):
    return 0.25

def bad_reward(item, text):
    return "high"

class Shout:
    name = "shout"
    description = "upper-cases"
    parameters = {"type": "object"}
    async def call(self, arguments, *, timeout_s):
        return str(arguments).upper()
    async def close(self):
        pass

broken = 1 +
"""


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    ok, _, broken = USER_ENV.rpartition("broken")
    (tmp_path / "user_env.py").write_text(textwrap.dedent(ok))
    (tmp_path / "user_broken.py").write_text("broken" + broken)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_env"


def cfg_with(*overrides):
    return load_config("configs/tiny.toml", list(overrides))


def test_builtin_and_user_environments_load(user_module):
    assert get_env("searchr1").name == "searchr1"
    env = get_env("user_env:ENV")
    assert env.name == "upper" and get_env("user_env:Upper").name == "upper"  # a class is instantiated
    lines = check_agent(cfg_with('agentloop.task_name="user_env:ENV"', 'agentloop.reward_path="user_env:reward"'))
    assert lines == ["environment 'user_env:ENV' (Upper), tools: calculator, reward user_env:reward"]
    assert load_reward("user_env:reward")(None, "x").reward == 0.25
    with pytest.raises(TypeError, match="agentloop.reward_path 'user_env:bad_reward': returned str"):
        load_reward("user_env:bad_reward")(None, "x")


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (
            ['agentloop.task_name="nope"'],
            "agentloop.task_name: unknown environment 'nope'; known: ['",
        ),
        (['agentloop.task_name="user_env:NOPE"'], "agentloop.task_name: module 'user_env' has no attribute 'NOPE'"),
        (
            ['agentloop.task_name="user_env:NOT_AN_ENV"'],
            "agentloop.task_name: 'user_env:NOT_AN_ENV' is a int, not an environment",
        ),
        (
            ['agentloop.task_name="user_broken:ENV"'],
            "agentloop.task_name: cannot import module 'user_broken' of 'user_broken:ENV': SyntaxError",
        ),
        (['agentloop.task_name="no_such_pkg.env:ENV"'], "cannot import module 'no_such_pkg.env'"),
        (
            ['agentloop.tools=["search", "bogus"]'],
            "agentloop.tools: unknown tool 'bogus'; built in: search, python, calculator",
        ),
        (
            ['agentloop.tools=["http:ftp://x"]'],
            "agentloop.tools: 'http:ftp://x': expected http:<http://host:port> of a tool server",
        ),
        (['agentloop.tools=["user_env:Missing"]'], "agentloop.tools: module 'user_env' has no attribute 'Missing'"),
        (['agentloop.tools=["search", "search"]'], "agentloop.tools: two tools named 'search'"),
        (
            ['agentloop.task_name="user_env:ENV"', 'agentloop.tools=["user_env:Shout"]'],
            "the environment's <calc> calls tool 'calculator', which is not among ['shout']",
        ),
        (
            ['agentloop.reward_path="user_env:nothing"'],
            "agentloop.reward_path: module 'user_env' has no attribute 'nothing'",
        ),
        (
            ['rollout_buffer.sample_filter_path="user_env:nothing"'],
            "rollout_buffer.sample_filter_path: module 'user_env' has no attribute",
        ),
    ],
)
def test_a_wrong_environment_tool_reward_or_hook_fails_the_dry_run_naming_the_key(user_module, capsys, overrides, said):
    rc = main(["configs/tiny.toml", "--dry-run", *overrides])
    err = capsys.readouterr().err
    assert rc == 2 and said in err, err


def test_user_tools_and_a_tool_server_spec_pass_the_dry_run(user_module, capsys):
    rc = main(
        ["configs/tiny.toml", "--dry-run", 'agentloop.tools=["search", "user_env:Shout", "http:http://10.0.0.1:8100"]']
    )
    out = capsys.readouterr().out
    assert rc == 0 and "environment 'searchr1' (SearchR1Env), tools: search, shout, http:http://10.0.0.1:8100" in out
