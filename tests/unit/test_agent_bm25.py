"""The in-process BM25 retriever and the retriever factory."""

import asyncio
import json

import pytest

from asyncrl.agent.tools import make_retriever
from asyncrl.agent.tools.bm25 import BM25Retriever, read_corpus
from asyncrl.agent.tools.retrieval_server import parse_request
from asyncrl.config.schema import ToolConfig

DOCS = [
    {"id": "0", "contents": "Zorvania\nThe capital of Zorvania is Quelport."},
    {"id": "1", "contents": "Zorvania\nThe currency of Zorvania is the krell."},
    {"id": "2", "contents": "Brask\nThe capital of Brask is Tolm."},
    {"id": "3", "contents": "Tarin Velo\nTarin Velo was born in Brask."},
]


def test_search_ranks_the_matching_fact_first():
    r = BM25Retriever(DOCS)
    docs, scores = r.search(["capital of Zorvania", "Tarin Velo born", "currency of Zorvania"], topk=2)
    assert [d[0]["id"] for d in docs] == ["0", "3", "1"]
    assert all(len(d) == 2 for d in docs)
    assert all(s[0] >= s[1] > -1 for s in scores) and scores[0][0] > 0


def test_topk_is_clamped_and_unknown_words_still_return_documents():
    r = BM25Retriever(DOCS)
    docs, scores = r.search(["xyzzy", ""], topk=10)
    assert [len(d) for d in docs] == [4, 4]
    assert all(s == 0.0 for row in scores for s in row)
    assert r.search([], topk=3) == ([], [])


def test_async_retrieve_matches_search_across_event_loops():
    r = BM25Retriever(DOCS)
    for _ in range(2):  # a fresh event loop each time must work
        got = asyncio.run(r.retrieve(["capital of Brask"], topk=1))
        assert got == [[DOCS[2]]]
    asyncio.run(r.close())


def test_read_corpus_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_corpus(tmp_path / "nope.jsonl")
    p = tmp_path / "c.jsonl"
    p.write_text('{"id": "1", "contents": "a\\nb"}\n{"id": "2"}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:2: no 'contents'"):
        read_corpus(p)


def test_make_retriever_from_tool_config(tmp_path):
    p = tmp_path / "corpus.jsonl"
    p.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    r = make_retriever(ToolConfig(retriever="bm25", corpus_path=str(p)))
    assert isinstance(r, BM25Retriever) and str(p) in r.name
    with pytest.raises(ValueError, match="agentloop.tool.corpus_path"):
        make_retriever(ToolConfig(retriever="bm25"))
    with pytest.raises(ValueError, match="agentloop.tool.retriever_url"):
        make_retriever(ToolConfig(retriever="http"))
    h = make_retriever(ToolConfig(retriever="http", retriever_url="http://127.0.0.1:9/retrieve", max_retries=5))
    assert h.name == "http://127.0.0.1:9/retrieve" and h.max_retries == 5


@pytest.mark.parametrize(
    "body, error",
    [
        ([], "JSON object"),
        ({"queries": "q"}, "'queries'"),
        ({"queries": ["q"], "topk": 0}, "'topk'"),
        ({"queries": ["q"], "topk": True}, "'topk'"),
        ({"queries": ["q"], "return_scores": "yes"}, "'return_scores'"),
    ],
)
def test_server_request_validation(body, error):
    with pytest.raises(ValueError, match=error):
        parse_request(body, 3)
    assert parse_request({"queries": ["a", "b"]}, 3) == (["a", "b"], 3, False)
