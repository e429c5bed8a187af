"""Tools in the agent loop: several tools in one episode, several calls in one turn (run concurrently), and a tool
that hangs, raises, fails or is unknown -- each an observation the policy sees plus tool/<name>/errors, never a
crashed group; a tool whose infrastructure fails aborts the trajectory. Against the scripted engine of
test_agent_loop (SGLang's /generate reply shape); the tools are real asyncio tools."""

import asyncio
import json
import time

import pytest
from test_agent_loop import ScriptedEngine

from asyncrl.agent.envs import Environment, QwenFormat, Score, TagFormat, load_reward
from asyncrl.agent.loop import AgentLoop, EngineHandle, trajectory_metrics
from asyncrl.agent.tokenizer import AgentTokenizer
from asyncrl.agent.tools.base import ToolError, ToolUnavailable
from asyncrl.broker.types import Group, PromptItem
from asyncrl.config.schema import AgentLoopConfig, SamplingConfig
from asyncrl.trainer.leader import rollout_metrics

ITEM = PromptItem(index=0, prompt="six times seven", answers=["42"])


class ToyEnv(Environment):
    name = "toy"
    format = TagFormat(calls={"calc": ("calc", "expression"), "py": ("python", "code"), "ask": ("nope", "q")})

    def prompt(self, item, *, tools, chat_template=False, tokenizer=None):
        return f"Solve with tools ({', '.join(t.name for t in tools)}): {item.prompt}\n"

    def score(self, item, generated_text):
        return Score(float("<answer> 42 </answer>" in generated_text), {"said_42": float("42" in generated_text)})


class QwenEnv(ToyEnv):
    format = QwenFormat()


class Calc:
    name, description = "calc", "arithmetic"
    parameters = {"type": "object", "properties": {"expression": {"type": "string"}}}

    def __init__(self, started=None):
        self.started = started

    async def call(self, arguments, *, timeout_s):
        if self.started is not None:  # both calls of a turn must run at once: each waits for the other to start
            self.started.append(self.name)
            deadline = time.monotonic() + 5
            while len(self.started) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            if len(self.started) < 2:
                raise ToolError("the other call never started")
        expr = arguments["expression"].strip()
        if expr == "hang":
            await asyncio.Event().wait()
        if expr == "boom":
            raise ValueError("boom")
        if expr == "refuse":
            raise ToolError("cannot evaluate: refuse")
        if expr == "down":
            raise ToolUnavailable("calc server http://calc:1 is down")
        a, b = expr.split("*")
        return str(int(a) * int(b))

    async def close(self):
        pass


class Py(Calc):
    name = "python"

    async def call(self, arguments, *, timeout_s):
        return f"ran {arguments['code'].strip()!r}"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from asyncrl.models.tiny import make_tiny_checkpoint

    d = tmp_path_factory.mktemp("tok")
    text = d / "text.txt"
    lines = [
        "Solve with tools (calc, python): six times seven",
        "<calc> 6*7 </calc> <py> print(42) </py> <answer> 42 </answer> <result> error: timed out after s </result>",
        '<tool_call>{"name": "calc", "arguments": {"expression": "6*7"}}</tool_call> <tool_response> ran raised',
        "unknown tool nope ValueError boom cannot evaluate refuse hang down",
    ]
    text.write_text("\n".join(lines * 20))
    path = make_tiny_checkpoint(
        d / "m", corpus_path=text, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, vocab_size=400,
    )  # fmt: skip
    return AgentTokenizer.from_pretrained(path)


def make_loop(tok, env=None, tools=None, **kw):
    cfg = AgentLoopConfig(
        **{"task_name": "toy", "max_turns": 4, "max_tokens_per_turn": 40, "max_total_tokens": 600, **kw}
    )
    tools = tools if tools is not None else {"calc": Calc(), "python": Py()}
    return AgentLoop(env=env or ToyEnv(), tokenizer=tok, tools=tools, agent_cfg=cfg, sampling=SamplingConfig())


def run(loop, replies, **kw):
    eng = ScriptedEngine(loop.tokenizer, replies, **kw)
    handle = EngineHandle(None, max_in_flight=4, url="http://e0", generate_raw=eng)
    return asyncio.run(loop.run_trajectory(ITEM, handle)), eng


def response_text(tok, t):
    return tok.decode(t.response_ids)


def test_two_tools_in_one_episode(tok):
    loop = make_loop(tok)
    t, eng = run(loop, ["<calc> 6*7 </calc>", "<py> print(42) </py>", "<answer> 42 </answer>"])
    assert not t.aborted and t.finish_reason == "answer" and t.reward == 1.0 and t.num_tool_calls == 2
    text = response_text(tok, t)
    assert "<result>42</result>" in text and "<result>ran 'print(42)'</result>" in text
    m = trajectory_metrics(t)
    assert m == {"tool/calc/calls": 1.0, "tool/python/calls": 1.0, "env/said_42": 1.0}
    assert "calc, python" in tok.decode(eng.calls[0][0])  # the environment saw its tools when it wrote the prompt
    assert set(eng.calls[0][1]["stop"]) == {"</calc>", "</py>", "</ask>", "</answer>"}


@pytest.mark.parametrize(
    ("expr", "said"),
    [
        ("hang", "error: calc timed out after 0.3 s"),
        ("boom", "error: calc raised ValueError: boom"),
        ("refuse", "error: cannot evaluate: refuse"),
    ],
)
def test_a_tool_that_hangs_raises_or_refuses_is_an_observation_and_the_episode_goes_on(tok, expr, said):
    loop = make_loop(tok, tool_timeout_s=0.3)
    t0 = time.monotonic()
    t, _ = run(loop, [f"<calc> {expr} </calc>", "<answer> 42 </answer>"])
    assert time.monotonic() - t0 < 10
    assert not t.aborted and t.finish_reason == "answer" and t.reward == 1.0
    assert said in response_text(tok, t)
    m = trajectory_metrics(t)
    assert m["tool/calc/calls"] == 1.0 and m["tool/calc/errors"] == 1.0


def test_an_unknown_tool_is_named_to_the_policy(tok):
    t, _ = run(make_loop(tok), ["<ask> what </ask>", "<answer> 42 </answer>"])
    assert "error: unknown tool 'nope'; tools: calc, python" in response_text(tok, t)
    assert trajectory_metrics(t)["tool/unknown/errors"] == 1.0 and not t.aborted


def test_an_unavailable_tool_aborts_the_trajectory_never_scored(tok):
    t, _ = run(make_loop(tok), ["<calc> down </calc>", "<answer> 42 </answer>"])
    assert t.aborted and t.reward == 0.0 and t.extra["error_kind"] == "tool" and "http://calc:1" in t.error


def test_calls_of_one_turn_run_concurrently_and_answer_in_call_order(tok):
    started: list = []
    tools = {"calc": Calc(started), "python": Calc(started)}
    tools["python"].name = "python"
    two = (
        '<tool_call>{"name": "calc", "arguments": {"expression": "6*7"}}</tool_call>'
        '<tool_call>{"name": "python", "arguments": {"expression": "2*3"}}</tool_call>'
    )
    loop = make_loop(tok, env=QwenEnv(), tools=tools, max_tokens_per_turn=200)
    t, _ = run(loop, [two, "<answer> 42 </answer>"], eos_after={0, 1})
    text = response_text(tok, t)
    assert "<tool_response>\n42\n</tool_response>\n<tool_response>\n6\n</tool_response>" in text, text
    assert t.num_tool_calls == 2 and t.num_turns == 2 and t.finish_reason == "answer"


def test_an_eos_after_a_call_is_not_the_end_of_the_episode(tok):
    """Chat models end a tool-calling turn with their end-of-turn token (EOS): the episode goes on."""
    call = '<tool_call>{"name": "calc", "arguments": {"expression": "6*7"}}</tool_call>'
    t, eng = run(make_loop(tok, env=QwenEnv()), [call, "It is 42."], eos_after={0, 1})
    assert len(eng.calls) == 2 and t.finish_reason == "answer" and t.num_tool_calls == 1


def my_reward(item, generated_text):
    return Score(0.5, {"custom": 1.0})


def test_reward_path_replaces_the_environment_score(tok):
    loop = make_loop(tok)
    loop.reward = load_reward("test_env_tools_loop:my_reward")
    t, _ = run(loop, ["<answer> 42 </answer>"])
    assert t.reward == 0.5 and trajectory_metrics(t) == {"env/custom": 1.0}


def test_the_batch_metrics_sum_tool_counts_and_average_env_metrics(tok):
    loop = make_loop(tok, tool_timeout_s=0.3)
    a, _ = run(loop, ["<calc> boom </calc>", "<py> x </py>", "<answer> 42 </answer>"])
    b, _ = run(loop, ["<answer> 7 </answer>"])
    m = rollout_metrics([Group(0, ITEM, 0, trajectories=[a, b])])
    assert m["tool/calc/calls"] == 1.0 and m["tool/calc/errors"] == 1.0 and m["tool/python/calls"] == 1.0
    assert m["tool/errors"] == 1.0 and m["env/said_42"] == 0.5 and m["reward/mean"] == 0.5
    assert json.loads(a.extra["metrics"])["tool/calc/errors"] == 1
