"""The agent loop's bookkeeping against a scripted engine (the engine is the outside edge here;
tests/integration/test_agent_loop_cpu_engine.py runs the same loop against the real CPU engine).

The scripted engine behaves as SGLang's /generate: it tokenizes a scripted reply, cuts it at the
first stop string (keeping the stop tokens) or at max_new_tokens, and returns output_ids with
aligned output_token_logprobs, finish_reason and weight_versions.
"""

import asyncio
import json
import time

import pytest

from asyncrl.agent.engine_handle import gen_output, token_versions
from asyncrl.agent.envs import get_env, searchr1
from asyncrl.agent.loop import AgentLoop, EngineError, EngineHandle
from asyncrl.agent.tokenizer import AgentTokenizer
from asyncrl.agent.tools import RetrieverError
from asyncrl.agent.tools.bm25 import BM25Retriever
from asyncrl.broker.types import Group, PromptItem
from asyncrl.config.schema import AgentLoopConfig, SamplingConfig, ToolConfig
from asyncrl.engine.client import parse_generate_response

DOCS = [
    {"id": "0", "contents": "Zorvania\nThe capital of Zorvania is Quelport."},
    {"id": "1", "contents": "Brask\nThe capital of Brask is Tolm."},
    {"id": "2", "contents": "Tarin Velo\nTarin Velo was born in Brask."},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from asyncrl.models.tiny import make_tiny_checkpoint

    d = tmp_path_factory.mktemp("tok")
    text = d / "text.txt"
    lines = [doc["contents"] for doc in DOCS] + [searchr1.build_prompt("What is the capital of Zorvania")] * 3
    lines += [searchr1.INVALID_ACTION_MESSAGE, "<search> capital of Zorvania </search> <answer> Quelport </answer>"]
    text.write_text("\n".join(lines * 5))
    path = make_tiny_checkpoint(
        d / "m",
        corpus_path=text,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=400,
    )
    return AgentTokenizer.from_pretrained(path)


class ScriptedEngine:
    """Replies with scripted texts, turn after turn, per trajectory (keyed by the rid's trajectory part)."""

    def __init__(self, tok, replies, *, version="3", split_at=None, eos_after=(), fail_on_call=None, abort_first=False):
        self.tok, self.replies, self.version = tok, list(replies), version
        self.split_at, self.eos_after, self.fail_on_call = split_at, set(eos_after), fail_on_call
        self.abort_first = abort_first
        self.calls = []
        self.turn_of = {}

    async def __call__(self, input_ids, params, rid):
        self.calls.append((list(input_ids), dict(params), rid))
        if self.fail_on_call is not None and len(self.calls) == self.fail_on_call:
            raise ConnectionResetError("engine went away")
        key = rid.rsplit("-t", 1)[0]
        turn = self.turn_of.get(key, 0)
        text = self.replies[min(turn, len(self.replies) - 1)]
        cut = min((text.index(s) + len(s) for s in params["stop"] if s in text), default=None)
        if cut is not None:
            text = text[:cut]
        ids = self.tok.encode(text)
        finish = {"type": "stop", "matched": next((s for s in params["stop"] if text.endswith(s)), None)}
        if cut is None and turn in self.eos_after:
            ids = ids + [self.tok.eos_token_ids[0]]
            finish = {"type": "stop", "matched": self.tok.eos_token_ids[0]}
        if cut is None and turn not in self.eos_after:
            finish = {"type": "length", "length": params["max_new_tokens"]}
        if len(ids) > params["max_new_tokens"]:
            ids = ids[: params["max_new_tokens"]]
            finish = {"type": "length", "length": params["max_new_tokens"]}
        if self.abort_first and len(self.calls) == 1:
            ids = ids[:2]
            finish = {"type": "abort", "message": "Aborted"}
        else:
            self.turn_of[key] = turn + 1
        meta = {
            "finish_reason": finish,
            "weight_version": self.version,
            "output_token_logprobs": [[-0.01 * (j + 1), t, None] for j, t in enumerate(ids)],
            "num_retractions": 0,
        }
        if self.split_at is not None and len(ids) > self.split_at:
            meta["weight_versions"] = [
                {"version": "2", "start": 0, "end": self.split_at},
                {"version": self.version, "start": self.split_at, "end": len(ids)},
            ]
            meta["num_retractions"] = 1
        return {"text": text, "output_ids": ids, "meta_info": meta}


def make_loop(tok, **agent_kw):
    tool = ToolConfig(topk=agent_kw.pop("topk", 2), max_obs_tokens=agent_kw.pop("max_obs_tokens", 200))
    cfg = AgentLoopConfig(
        task_name="searchr1",
        tool=tool,
        **{"max_turns": 3, "max_tokens_per_turn": 24, "max_total_tokens": 400, **agent_kw},
    )
    return AgentLoop(
        env=get_env("searchr1"),
        tokenizer=tok,
        retriever=BM25Retriever(DOCS),
        agent_cfg=cfg,
        sampling=SamplingConfig(temperature=1.0),
    )


ITEM = PromptItem(index=0, prompt="What is the capital of Zorvania", answers=["Quelport"])


def run(loop, engine, **kw):
    return asyncio.run(
        loop.run_trajectory(ITEM, EngineHandle(None, max_in_flight=4, url="http://e0", generate_raw=engine), **kw)
    )


def test_search_then_answer_ids_masks_logprobs_versions(tok):
    loop = make_loop(tok)
    eng = ScriptedEngine(
        tok, ["<search> capital of Zorvania </search> ignored", "<answer> Quelport </answer>"], split_at=3
    )
    t = run(loop, eng)
    prompt_ids = tok.encode(searchr1.build_prompt(ITEM.prompt))
    gen1 = tok.encode("<search> capital of Zorvania </search>")
    obs = tok.encode(searchr1.format_observation(loop.retriever.search(["capital of Zorvania"], 2)[0][0]))
    gen2 = tok.encode("<answer> Quelport </answer>")
    assert t.prompt_ids == prompt_ids
    assert t.response_ids == gen1 + obs + gen2
    assert t.loss_mask == [1] * len(gen1) + [0] * len(obs) + [1] * len(gen2)
    # log-probs are the engine's, position by position; 0.0 on tool tokens
    assert t.rollout_logprobs == [-0.01 * (j + 1) for j in range(len(gen1))] + [0.0] * len(obs) + [
        -0.01 * (j + 1) for j in range(len(gen2))
    ]
    assert t.weight_versions == [2] * 3 + [3] * (len(gen1) - 3) + [-1] * len(obs) + [2] * 3 + [3] * (len(gen2) - 3)
    assert (t.min_version, t.max_version, t.num_retractions) == (2, 3, 2)
    assert (t.reward, t.finish_reason, t.num_turns, t.num_tool_calls, t.truncated, t.aborted) == (
        1.0,
        "answer",
        2,
        1,
        False,
        False,
    )
    # the second generate call saw exactly prompt + turn 1 + observation (token in, token out)
    assert eng.calls[1][0] == prompt_ids + gen1 + obs
    assert eng.calls[0][1]["stop"] == ["</search>", "</answer>"] and eng.calls[0][1]["max_new_tokens"] == 24
    assert set(t.timings) >= {"generate_s", "tool_s", "total_s"}


def test_prompt_example_answer_is_never_scored(tok):
    """The prompt contains '<answer> Beijing </answer>': a model that says nothing useful gets 0."""
    loop = make_loop(tok, max_turns=1)
    item = PromptItem(index=0, prompt="What is the capital of China", answers=["Beijing"])
    eng = ScriptedEngine(tok, ["I do not know"], eos_after={0})
    t = asyncio.run(loop.run_trajectory(item, EngineHandle(None, max_in_flight=1, url="u", generate_raw=eng)))
    assert "<answer> Beijing </answer>" in tok.decode(t.prompt_ids)
    assert t.reward == 0.0 and t.finish_reason == "eos"


def test_invalid_action_message_then_max_turns(tok):
    loop = make_loop(tok, max_turns=2)
    eng = ScriptedEngine(tok, ["hmm <search> unclosed", "still nothing"])
    t = run(loop, eng)
    inv = tok.encode(searchr1.INVALID_ACTION_MESSAGE)
    g1, g2 = tok.encode("hmm <search> unclosed"), tok.encode("still nothing")
    assert t.response_ids == g1 + inv + g2
    assert t.loss_mask == [1] * len(g1) + [0] * len(inv) + [1] * len(g2)
    assert (t.finish_reason, t.num_turns, t.num_tool_calls, t.reward) == ("max_turns", 2, 0, 0.0)
    # a search in the last allowed turn is not executed
    t = run(make_loop(tok, max_turns=1), ScriptedEngine(tok, ["<search> capital of Zorvania </search>"]))
    assert (t.finish_reason, t.num_tool_calls, t.loss_mask.count(0)) == ("max_turns", 0, 0)


def test_total_length_limit_cuts_cleanly(tok):
    prompt_len = len(tok.encode(searchr1.build_prompt(ITEM.prompt)))
    # room for the first turn but not for the observation plus one more token
    loop = make_loop(tok, max_total_tokens=prompt_len + 14)
    t = run(loop, ScriptedEngine(tok, ["<search> capital of Zorvania </search>", "<answer> Quelport </answer>"]))
    assert t.truncated and t.finish_reason == "length"
    assert t.loss_mask == [1] * len(t.response_ids)  # no dangling tool tokens
    assert len(t.prompt_ids) + len(t.response_ids) <= prompt_len + 14
    # a generate call never asks past the total limit
    loop = make_loop(tok, max_total_tokens=prompt_len + 5)
    eng = ScriptedEngine(tok, ["<answer> a very long answer that does not fit in five tokens </answer>"])
    t = run(loop, eng)
    assert eng.calls[0][1]["max_new_tokens"] == 5
    assert len(t.response_ids) == 5 and t.truncated and t.finish_reason == "length"


def test_observation_cut_keeps_closing_tag(tok):
    loop = make_loop(tok, max_obs_tokens=12)
    obs = loop.observation_ids(searchr1.format_observation(DOCS))
    assert len(obs) == 12
    assert tok.decode(obs).endswith("</information>\n\n") and tok.decode(obs).startswith("\n\n<information>")


def test_engine_failure_aborts_never_scores(tok):
    loop = make_loop(tok)
    eng = ScriptedEngine(tok, ["<search> capital of Zorvania </search>", "<answer> Quelport </answer>"], fail_on_call=2)
    t = run(loop, eng)
    assert t.aborted and t.finish_reason == "abort" and t.reward == 0.0
    assert "http://e0" in t.error and "ConnectionResetError" in t.error


class DeadRetriever:
    name = "http://dead:1/retrieve"

    async def retrieve(self, queries, topk, *, stats=None):
        raise RetrieverError(f"retriever {self.name} failed after 4 attempts: refused")

    async def wait_available(self):
        pass

    async def close(self):
        pass


def test_retriever_failure_aborts_the_group(tok):
    loop = make_loop(tok)
    loop.retriever = DeadRetriever()
    eng = ScriptedEngine(tok, ["<search> capital of Zorvania </search>", "<answer> Quelport </answer>"])
    seen = []
    group = Group(group_id=7, item=ITEM, epoch=0)
    handle = EngineHandle(None, max_in_flight=2, url="http://e0", generate_raw=eng)
    group = asyncio.run(loop.run_group(group, handle, group_size=3, on_trajectory=lambda i, t: seen.append(i)))
    assert group.aborted and sorted(seen) == [0, 1, 2]
    assert all(t.aborted and "http://dead:1/retrieve" in t.error for t in group.trajectories)
    assert handle.load == 0 and handle.in_flight == 0


def test_engine_side_abort_keeps_partial_output_and_resumes(tok):
    loop = make_loop(tok)
    eng = ScriptedEngine(tok, ["<answer> Quelport </answer>"], abort_first=True)
    t = run(loop, eng)
    full = tok.encode("<answer> Quelport </answer>")
    assert len(eng.calls) == 2 and eng.calls[1][1]["max_new_tokens"] == 24 - 2
    assert eng.calls[1][0][-2:] == full[:2]
    # the scripted engine restarts its reply, so the response is the 2 partial tokens + a full reply
    assert t.response_ids == full[:2] + full and t.loss_mask == [1] * (len(full) + 2)
    assert t.reward == 1.0 and not t.aborted


def test_gate_holds_new_turns(tok):
    loop = make_loop(tok)
    eng = ScriptedEngine(tok, ["<answer> Quelport </answer>"])

    async def go():
        loop.gate.hold()
        handle = EngineHandle(None, max_in_flight=1, url="u", generate_raw=eng)
        task = asyncio.create_task(loop.run_trajectory(ITEM, handle))
        deadline = time.monotonic() + 30
        while loop.gate.num_waiting < 1:  # the first turn reached the closed gate
            assert time.monotonic() < deadline and not task.done(), "the turn never reached the gate"
            await asyncio.sleep(0.01)
        assert eng.calls == [] and not task.done()
        loop.gate.release()
        return await asyncio.wait_for(task, 10)

    assert asyncio.run(go()).reward == 1.0


def test_group_concurrency_bounded_per_engine(tok):
    loop = make_loop(tok)
    state = {"now": 0, "max": 0}
    inner = ScriptedEngine(tok, ["<search> capital of Zorvania </search>", "<answer> Quelport </answer>"])

    async def slow(input_ids, params, rid):
        state["now"] += 1
        state["max"] = max(state["max"], state["now"])
        await asyncio.sleep(0.01)
        state["now"] -= 1
        return await inner(input_ids, params, rid)

    handle = EngineHandle(None, max_in_flight=2, url="u", generate_raw=slow)
    group = asyncio.run(loop.run_group(Group(group_id=1, item=ITEM, epoch=0), handle, group_size=6))
    assert state["max"] == 2
    assert [t.reward for t in group.trajectories] == [1.0] * 6 and not group.aborted
    rids = [c[2] for c in inner.calls]
    assert len(set(rids)) == len(rids)


def test_evaluate_is_greedy_and_reports_accuracy(tok):
    loop = make_loop(tok)
    eng = ScriptedEngine(tok, ["<answer> Quelport </answer>"])
    items = [ITEM, PromptItem(index=1, prompt="What is the capital of Brask", answers=["Tolm"])]
    out = asyncio.run(loop.evaluate(items, [EngineHandle(None, max_in_flight=2, url="u", generate_raw=eng)]))
    assert out["accuracy"] == 0.5 and out["num_prompts"] == 2 and out["num_aborted"] == 0
    assert all(c[1]["temperature"] == 0.0 for c in eng.calls)


def test_generate_reply_parsing_errors_name_the_engine():
    def parse(resp, url):  # the loop's path: the engine package's parser, then the loop's view of it
        return gen_output(parse_generate_response(resp, url), url)

    ok = {
        "output_ids": [5, 6],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 0},
            "output_token_logprobs": [[-1.0, 5, None], [-2.0, 6, None]],
            "weight_version": "4",
        },
    }
    out = parse(ok, "http://e")
    assert out.logprobs == [-1.0, -2.0] and out.versions == [4, 4] and out.finish_matched == 0
    bad = json.loads(json.dumps(ok))
    bad["meta_info"]["output_token_logprobs"][1][1] = 9
    with pytest.raises(EngineError, match="http://e"):
        parse(bad, "http://e")
    with pytest.raises(EngineError, match="no output_token_logprobs"):
        parse({"output_ids": [1], "meta_info": {}}, "http://e")
    assert token_versions(
        {"weight_version": "5", "weight_versions": [{"version": "4", "start": 0, "end": 1}]}, 3, "u"
    ) == [4, 5, 5]
    with pytest.raises(EngineError, match="not an integer"):
        token_versions({"weight_version": "abc"}, 1, "http://e")


def test_routed_experts_replies_are_checked():
    """``routed_from``: the reply's ``meta_info["routed_experts"]`` (base64 of int32 [rows, layers, top-k]) must hold
    the rows of positions ``routed_from .. prompt + output - 2``; a request aborted while it waited has none."""
    import base64

    import numpy as np

    rows = np.arange(3 * 2 * 2, dtype=np.int32).reshape(3, 2, 2)  # prompt 3 + output 2 - 1 - start 1 = 3 rows

    def reply(meta_extra: dict, output_ids=(5, 6), finish="stop") -> dict:
        return {
            "output_ids": list(output_ids),
            "meta_info": {
                "finish_reason": {"type": finish},
                "output_token_logprobs": [[-1.0, t, None] for t in output_ids],
                **meta_extra,
            },
        }

    def parse(resp, routed_from=1):
        return gen_output(parse_generate_response(resp, "http://e"), "http://e", prompt_len=3, routed_from=routed_from)

    good = reply({"routed_experts": base64.b64encode(rows.tobytes()).decode()})
    assert parse(good).routed_experts.tolist() == rows.reshape(3, 4).tolist()
    assert parse(good, routed_from=None).routed_experts is None  # not asked: not read
    for meta, match in (
        ({}, "no routed_experts.*--enable-return-routed-experts"),
        ({"routed_experts": "!!"}, "not base64"),
        ({"routed_experts": base64.b64encode(rows[:2].tobytes()).decode()}, "are not 3 rows"),
        ({"routed_experts": base64.b64encode(b"\0" * 10).decode()}, "are not 3 rows"),
    ):
        with pytest.raises(EngineError, match=match):
            parse(reply(meta))
    assert parse(reply({}, output_ids=(), finish="abort")).routed_experts is None  # aborted while waiting
