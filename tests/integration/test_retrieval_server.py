"""The Search-R1 /retrieve server over real HTTP, and the HTTP retriever's retries."""

import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from aiohttp import web

from asyncrl.agent.tools import RetrieverError
from asyncrl.agent.tools.http_retriever import HttpRetriever

pytestmark = pytest.mark.slow

DOCS = [
    {"id": "0", "contents": "Zorvania\nThe capital of Zorvania is Quelport."},
    {"id": "1", "contents": "Zorvania\nThe currency of Zorvania is the krell."},
    {"id": "2", "contents": "Brask\nThe capital of Brask is Tolm."},
]


def start_server(corpus, timeout_s=60.0):
    """Start the server on a free port; returns (process, url). The caller kills the process."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.agent.tools.retrieval_server", "--corpus", str(corpus), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + timeout_s
    line = ""
    while time.monotonic() < deadline and not line:
        if proc.poll() is not None:
            raise RuntimeError(f"retrieval server exited: {proc.stderr.read()}")
        line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise TimeoutError("retrieval server did not start")
    return proc, json.loads(line)["url"]


def post(url, body, timeout_s=10.0):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def server(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    proc, url = start_server(corpus)
    yield proc, url
    proc.kill()
    proc.wait(timeout=10)


def test_search_r1_request_shapes(server):
    _, url = server
    status, body = post(url, {"queries": ["capital of Zorvania", "capital of Brask"], "topk": 2, "return_scores": True})
    assert status == 200
    assert [[e["document"]["id"] for e in row][0] for row in body["result"]] == ["0", "2"]
    assert [len(row) for row in body["result"]] == [2, 2]
    assert body["result"][0][0]["document"] == DOCS[0]
    assert body["result"][0][0]["score"] > body["result"][0][1]["score"]
    # without scores each entry is the document itself; topk defaults to the server's --topk (3)
    status, body = post(url, {"queries": ["currency of Zorvania"]})
    assert status == 200 and body["result"][0][0] == DOCS[1] and len(body["result"][0]) == 3
    status, body = post(url, {"queries": "not a list"})
    assert status == 400 and "queries" in body["error"]


BAD_RETRIEVE = [
    (b'{"queries": ["a", 5]}', "queries[1]"),
    (b'{"queries": ["a"], "topk": 1e400}', "topk"),
    (b'{"queries": ["a"], "topk": NaN}', "topk"),
    (b'{"queries": ["a"], "topk": 9223372036854775808}', "topk"),
    (b'{"queries": ["a"], "topk": 2.0}', "topk"),
    (b'{"queries": ["a"], "topk": true}', "topk"),
    (b'{"queries": ["a"], "return_scores": "false"}', "return_scores"),
    (json.dumps({"queries": ["q"] * 5000}).encode(), "queries"),
    (json.dumps({"queries": ["q" * 70000]}).encode(), "queries[0]"),
    (b"[1, 2]", "body"),
    (b"\xff\xfe", "JSON"),
    (b"[" * 100_000, "JSON"),
]


@pytest.mark.parametrize("raw,field", BAD_RETRIEVE, ids=[f for _, f in BAD_RETRIEVE])
def test_bad_retrieve_request_is_400_naming_the_field(server, raw, field):
    """Each malformed /retrieve body is a 400 whose error names the field; the server answers after it."""
    proc, url = server
    req = urllib.request.Request(url, data=raw, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400
    assert field in json.loads(err.value.read())["error"]
    assert proc.poll() is None and post(url, {"queries": ["capital of Brask"], "topk": 1})[0] == 200


def test_http_retriever_against_the_server(server):
    _, url = server

    async def go():
        r = HttpRetriever(url, timeout_s=10, max_retries=1, backoff_s=0.01)
        try:
            return await r.retrieve(["capital of Brask", "currency of Zorvania"], topk=1)
        finally:
            await r.close()

    assert asyncio.run(go()) == [[DOCS[2]], [DOCS[1]]]


def test_retries_with_backoff_then_success_then_error_naming_the_url():
    """A server that fails twice and then answers: the client retries; one that never answers: error."""

    async def go():
        calls = {"n": 0}

        async def flaky(request):
            calls["n"] += 1
            if calls["n"] <= 2:
                return web.json_response({"error": "busy"}, status=503)
            body = await request.json()
            return web.json_response({"result": [[DOCS[0]] for _ in body["queries"]]})

        app = web.Application()
        app.router.add_post("/retrieve", flaky)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}/retrieve"
        r = HttpRetriever(url, timeout_s=30, max_retries=3, backoff_s=0.01)
        try:
            got = await r.retrieve(["q"], topk=1)
            assert got == [[DOCS[0]]] and r.num_retries == 2 and calls["n"] == 3
        finally:
            await r.close()
            await runner.cleanup()
        # the port is closed now: every attempt fails, then the error names the URL
        r = HttpRetriever(url, timeout_s=1, max_retries=2, backoff_s=0.01)
        try:
            with pytest.raises(RetrieverError, match=f"retriever {url} failed after 3 attempts"):
                await r.retrieve(["q"], topk=1)
            assert r.num_retries == 2 and r.num_failures == 1
        finally:
            await r.close()

    asyncio.run(go())
