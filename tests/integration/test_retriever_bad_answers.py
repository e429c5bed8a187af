"""The HTTP retriever against a real /retrieve server on 127.0.0.1 that answers bad bodies: rows that are not
lists, a ``contents`` that is not a string, a body over the size cap (with a Content-Length, and chunked). Each
is a failed attempt like a non-200 (retried, counted in ``num_errors``), and after the retries a
``RetrieverError`` naming the URL and what was wrong."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from asyncrl.agent.tools import RetrieverError, http_retriever
from asyncrl.agent.tools.http_retriever import HttpRetriever

pytestmark = pytest.mark.slow

GOOD = {"result": [[{"document": {"id": "0", "contents": "Zorvania\nThe capital is Quelport."}, "score": 1.0}]]}


async def _serve(answers: list):
    """A /retrieve server answering ``answers`` in turn (the last one from then on): a JSON body, or a callable
    ``(request) -> response``. Returns (runner, url, calls)."""
    calls = {"n": 0}

    async def retrieve(request):
        a = answers[min(calls["n"], len(answers) - 1)]
        calls["n"] += 1
        return await a(request) if callable(a) else web.json_response(a)

    app = web.Application()
    app.router.add_post("/retrieve", retrieve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}/retrieve", calls


def _fails(answer, *, max_retries: int = 1) -> tuple[str, HttpRetriever, dict, str]:
    """Retrieve once against a server that always gives ``answer`` -> (error text, retriever, calls, url)."""

    async def go():
        runner, url, calls = await _serve([answer])
        r = HttpRetriever(url, timeout_s=30, max_retries=max_retries, backoff_s=0.01)
        try:
            with pytest.raises(RetrieverError) as e:
                await r.retrieve(["q"], topk=1)
            return str(e.value), r, calls, url
        finally:
            await r.close()
            await runner.cleanup()

    return asyncio.run(go())


@pytest.mark.parametrize(
    "body,what",
    [
        ({"result": [5]}, "result[0]"),
        ({"result": ["doc"]}, "result[0]"),
        ({"result": [{"contents": "x"}]}, "result[0]"),
        ({"result": [[{"document": {"id": "0", "contents": 5}}]]}, "'contents'"),
        ({"result": [[{"id": "0", "contents": None}]]}, "'contents'"),
        ({"result": [[{"id": "0", "contents": ["a"]}]]}, "'contents'"),
    ],
)
def test_malformed_rows_are_retried_then_an_error_naming_the_url(body, what):
    err, r, calls, url = _fails(body, max_retries=2)
    assert f"retriever {url} failed after 3 attempts" in err and what in err, err
    assert calls["n"] == 3 and r.num_errors == 3 and r.num_retries == 2 and r.num_failures == 1


def test_a_malformed_answer_then_a_good_one_is_a_retry_not_a_failure():
    async def go():
        runner, url, calls = await _serve([{"result": [5]}, GOOD])
        r = HttpRetriever(url, timeout_s=30, max_retries=2, backoff_s=0.01)
        try:
            stats: dict = {}
            docs = await r.retrieve(["q"], topk=1, stats=stats)
            return docs, r, stats, calls
        finally:
            await r.close()
            await runner.cleanup()

    docs, r, stats, calls = asyncio.run(go())
    assert docs == [[GOOD["result"][0][0]["document"]]]
    assert calls["n"] == 2 and r.num_errors == 1 and stats == {"tool_errors": 1} and r.num_failures == 0


async def _too_large_with_length(request):
    return web.Response(body=b" " * (http_retriever.MAX_RESPONSE_BYTES + 1), content_type="application/json")


async def _too_large_chunked(request):
    resp = web.StreamResponse()
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    chunk = b" " * (1 << 20)
    sent = 0
    try:
        while sent <= http_retriever.MAX_RESPONSE_BYTES:
            await resp.write(chunk)
            sent += len(chunk)
        await resp.write_eof()
    except (ConnectionResetError, ConnectionError):  # the client stopped reading at the cap: expected
        pass
    return resp


@pytest.mark.parametrize("answer", [_too_large_with_length, _too_large_chunked], ids=["content-length", "chunked"])
def test_a_body_over_the_cap_is_an_error_naming_the_url_and_the_cap(answer):
    err, r, calls, url = _fails(answer)
    assert f"retriever {url} failed after 2 attempts" in err, err
    assert str(http_retriever.MAX_RESPONSE_BYTES) in err and "MAX_RESPONSE_BYTES" in err, err
    assert r.num_errors == 2
