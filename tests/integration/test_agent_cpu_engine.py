"""The agent loop against the real CPU engine (tiny Qwen2), the real SGLang client and real retrievers.

- token in, token out: each trajectory is exactly the prompt, the engine's returned ids and the
  tool's tokens concatenated, with masks, log-probs and versions aligned token by token;
- the retrieval server is killed mid-run: the HTTP retriever retries, then the group is aborted
  (never scored 0).
"""

import asyncio

import pytest
from agent_fixtures import make_scripted_model, start_cpu_engine, start_retrieval_server

from asyncrl.agent.envs import get_env, searchr1
from asyncrl.agent.loop import AgentLoop, EngineHandle
from asyncrl.agent.tokenizer import AgentTokenizer
from asyncrl.agent.tools.bm25 import BM25Retriever
from asyncrl.agent.tools.http_retriever import HttpRetriever
from asyncrl.broker.types import Group, PromptItem
from asyncrl.config.schema import AgentLoopConfig, SamplingConfig, ToolConfig
from asyncrl.engine.client import SGLangClient

pytestmark = pytest.mark.slow

TOPK = 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent_cpu")
    model = make_scripted_model(root, topk=TOPK)
    engine, url = start_cpu_engine(model.path, root / "engine.log")
    yield model, url, root
    engine.stop()


def make_loop(model, retriever, **kw):
    cfg = AgentLoopConfig(
        task_name="searchr1",
        max_turns=2,
        max_tokens_per_turn=24,
        max_total_tokens=400,
        tool=ToolConfig(topk=TOPK, max_obs_tokens=96),
        **kw,
    )
    return AgentLoop(
        env=get_env("searchr1"),
        tokenizer=AgentTokenizer.from_pretrained(model.path),
        retriever=retriever,
        agent_cfg=cfg,
        sampling=SamplingConfig(temperature=1.0),
    )


def test_trajectory_is_prompt_engine_ids_and_tool_tokens(setup):
    model, url, _ = setup
    bm25 = BM25Retriever.from_jsonl(model.data_dir / "corpus.jsonl")
    loop = make_loop(model, bm25)
    tok = loop.tokenizer
    item = PromptItem(index=0, prompt=model.question, answers=[model.answer])
    calls = []

    async def go():
        async with SGLangClient(url, request_timeout_s=60) as client:

            async def recorded(input_ids, params, rid):
                res = await client.generate(input_ids, params, rid=rid, return_logprob=True)
                calls.append((rid, list(input_ids), res))
                return {"output_ids": res.output_ids, "meta_info": res.meta_info}

            engine = EngineHandle(client, max_in_flight=4, generate_raw=recorded)
            return await loop.run_group(Group(group_id=1, item=item, epoch=0), engine, group_size=3)

    group = asyncio.run(go())
    assert not group.aborted and len(group.trajectories) == 3
    prompt_ids = tok.encode(searchr1.build_prompt(model.question))
    obs = tok.encode(searchr1.format_observation(bm25.search([model.query], TOPK)[0][0]))
    for i, t in enumerate(group.trajectories):
        mine = [c for c in calls if f"-g1-s{i}-" in c[0]]
        assert len(mine) == 2 == t.num_turns  # max_turns = 2: search, information, search (not executed)
        (_, in1, r1), (_, in2, r2) = mine
        # what the engine saw, and what the trajectory is: prompt | engine ids | tool ids | engine ids
        assert in1 == prompt_ids and in2 == prompt_ids + r1.output_ids + obs
        assert t.prompt_ids == prompt_ids
        assert t.response_ids == r1.output_ids + obs + r2.output_ids
        assert t.loss_mask == [1] * len(r1.output_ids) + [0] * len(obs) + [1] * len(r2.output_ids)
        assert t.rollout_logprobs == pytest.approx(r1.output_logprobs + [0.0] * len(obs) + r2.output_logprobs)
        assert t.weight_versions == [0] * len(r1.output_ids) + [-1] * len(obs) + [0] * len(r2.output_ids)
        assert r1.finish_reason == {"type": "stop", "matched": "</search>"}
        assert tok.decode(r1.output_ids) == tok.decode(r2.output_ids) == f"<search> {model.query}</search>"
        assert (t.reward, t.finish_reason, t.num_tool_calls, t.aborted) == (0.0, "max_turns", 1, False)
        assert t.timings["generate_s"] > 0 and t.timings["total_s"] >= t.timings["generate_s"]


def test_greedy_evaluation_against_the_engine(setup):
    model, url, _ = setup
    loop = make_loop(model, BM25Retriever.from_jsonl(model.data_dir / "corpus.jsonl"))
    items = [PromptItem(index=i, prompt=model.question, answers=[model.answer]) for i in range(3)]

    async def go():
        async with SGLangClient(url, request_timeout_s=60) as client:
            return await loop.evaluate(items, [EngineHandle(client, max_in_flight=2)])

    out = asyncio.run(go())
    assert out["num_prompts"] == 3 and out["num_aborted"] == 0
    assert out["accuracy"] == 0.0 and out["mean_tool_calls"] == 1.0 and out["mean_turns"] == 2.0


def test_retrieval_server_killed_mid_run_retries_then_aborts_the_group(setup):
    model, url, root = setup
    server, retrieve_url = start_retrieval_server(model.data_dir / "corpus.jsonl", root / "retrieval.log")
    retriever = HttpRetriever(retrieve_url, timeout_s=30, max_retries=2, backoff_s=0.05)
    loop = make_loop(model, retriever)
    item = PromptItem(index=0, prompt=model.question, answers=[model.answer])

    async def go():
        async with SGLangClient(url, request_timeout_s=60) as client:
            engine = EngineHandle(client, max_in_flight=1)
            try:
                healthy = await loop.run_group(Group(group_id=1, item=item, epoch=0), engine, group_size=2)
                first_turn_done = asyncio.Event()
                seen = []

                async def gen(input_ids, params, rid):
                    res = await client.generate(input_ids, params, rid=rid, return_logprob=True)
                    seen.append(rid)
                    first_turn_done.set()
                    return {"output_ids": res.output_ids, "meta_info": res.meta_info}

                engine2 = EngineHandle(client, max_in_flight=1, generate_raw=gen)
                task = asyncio.create_task(loop.run_group(Group(group_id=2, item=item, epoch=0), engine2, group_size=4))
                await asyncio.wait_for(first_turn_done.wait(), 60)
                server.stop()  # mid-run: the other trajectories have not searched yet
                broken = await asyncio.wait_for(task, 120)
                return healthy, broken
            finally:
                await retriever.close()

    try:
        healthy, broken = asyncio.run(go())
    finally:
        server.stop()
    assert not healthy.aborted and [t.num_tool_calls for t in healthy.trajectories] == [1, 1]
    assert broken.aborted
    failed = [t for t in broken.trajectories if t.aborted]
    assert failed and all(t.finish_reason == "abort" and retrieve_url in t.error for t in failed)
    assert all("failed after 3 attempts" in t.error for t in failed)
    assert retriever.num_retries >= 2 * len(failed) and retriever.num_failures == len(failed)
