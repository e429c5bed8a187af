"""Tool URLs in eval and at start, over real HTTP: the start-up check of each role that calls the retriever,
and an eval whose retriever goes away mid-run is an error naming the URL (before: aborted trajectories were
left out of the accuracy, so a dead retriever read as accuracy 0 with ``num_aborted`` = all)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from proc_helpers import free_port
from test_retrieval_server import DOCS, start_server

from asyncrl.agent.envs import get_env, searchr1
from asyncrl.agent.loop import AgentLoop, EngineHandle
from asyncrl.agent.tokenizer import AgentTokenizer
from asyncrl.agent.tools import RetrieverError, check_retriever
from asyncrl.agent.tools.http_retriever import HttpRetriever
from asyncrl.broker.types import PromptItem
from asyncrl.config.schema import AgentLoopConfig, SamplingConfig, ToolConfig
from asyncrl.eval.backends import EvalError, raise_tool_failures

pytestmark = pytest.mark.slow


@pytest.fixture
def server(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    proc, url = start_server(corpus)
    yield proc, url
    proc.kill()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from asyncrl.models.tiny import make_tiny_checkpoint

    d = tmp_path_factory.mktemp("tok")
    text = d / "text.txt"
    text.write_text(
        "\n".join(
            [doc["contents"] for doc in DOCS]
            + [searchr1.build_prompt("capital of Zorvania"), "<search> capital </search>"]
        )
        * 5
    )
    path = make_tiny_checkpoint(
        d / "m",
        corpus_path=text,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=300,
    )
    return AgentTokenizer.from_pretrained(path)


def test_start_check_passes_against_a_live_retriever(server):
    _, url = server
    check_retriever(ToolConfig(retriever="http", retriever_url=url), role="rollout rank 1 (engine 0)")


def test_start_check_fails_naming_the_url_and_the_role():
    url = f"http://127.0.0.1:{free_port()}/retrieve"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(RetrieverError) as e:
        check_retriever(
            ToolConfig(retriever="http", retriever_url=url, timeout_s=5, max_retries=3), role="actor rank 0 (eval)"
        )
    assert url in str(e.value) and "actor rank 0 (eval)" in str(e.value) and "retriever_url" in str(e.value)
    assert time.monotonic() - t0 < 10  # one attempt, no retries with backoff


def test_eval_with_the_retriever_gone_is_an_error_naming_the_url(server, tok):
    proc, url = server
    retriever = HttpRetriever(url, timeout_s=5, max_retries=1, backoff_s=0.01)
    cfg = AgentLoopConfig(
        task_name="searchr1",
        max_turns=2,
        max_tokens_per_turn=16,
        max_total_tokens=8192,
        tool=ToolConfig(retriever="http", retriever_url=url, topk=1),
    )
    loop = AgentLoop(
        env=get_env("searchr1"),
        tokenizer=tok,
        retriever=retriever,
        agent_cfg=cfg,
        sampling=SamplingConfig(temperature=0.0),
    )

    async def searching_engine(input_ids, params, rid):  # the engine is the edge here: it always searches
        ids = tok.encode("<search> capital </search>")
        return {
            "output_ids": ids,
            "meta_info": {
                "finish_reason": {"type": "stop", "matched": "</search>"},
                "weight_version": "0",
                "output_token_logprobs": [[-0.1, t, None] for t in ids],
            },
        }

    items = [PromptItem(index=i, prompt="capital of Zorvania", answers=["Quelport"]) for i in range(3)]

    async def evaluate():
        handle = EngineHandle(None, max_in_flight=4, url="http://engine", generate_raw=searching_engine)
        try:
            return await asyncio.gather(*(loop.run_trajectory(it, handle, greedy=True) for it in items))
        finally:
            await retriever.close()

    trajs = asyncio.run(evaluate())  # the retriever answers: no error
    raise_tool_failures(trajs, "test")
    assert not any(t.aborted for t in trajs) and all(t.num_tool_calls == 1 for t in trajs)
    proc.kill()
    proc.wait(timeout=10)
    trajs = asyncio.run(evaluate())
    assert all(t.aborted and t.extra["error_kind"] == "tool" for t in trajs)
    with pytest.raises(EvalError) as e:
        raise_tool_failures(trajs, "test")
    assert url in str(e.value) and "'test'" in str(e.value)
