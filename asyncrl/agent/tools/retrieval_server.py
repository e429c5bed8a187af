"""A Search-R1-compatible retrieval server over BM25: ``POST /retrieve``.

    python -m asyncrl.agent.tools.retrieval_server --corpus corpus.jsonl --port 8000 [--host H] [--topk 3]

Request ``{"queries": [str, ...], "topk": int (optional, default --topk), "return_scores": bool
(default false)}``. Response ``{"result": [[doc, ...], ...]}`` without scores, or
``{"result": [[{"document": doc, "score": float}, ...], ...]}`` with scores, where ``doc`` is the
corpus row (``{"id", "contents", ...}``), as Search-R1's own server answers. A malformed request
gets 400 ``{"error": "..."}`` naming the field (``queries[i]``, ``topk`` in [1, ``MAX_TOPK``], ...). ``GET /health`` -> ``{"status": "ok", "num_docs": N}``.

On start it prints one JSON line to stdout, ``{"url": "http://host:port/retrieve", "num_docs": N}``
(``--port 0`` picks a free port and the line says which).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from aiohttp import web

from asyncrl.agent.tools.bm25 import BM25Retriever

MAX_QUERIES = 4096  # queries in one request (the agent sends one per tool call; batching clients a few hundred)
MAX_QUERY_CHARS = 65536  # a search query longer than this is not one
MAX_TOPK = 1000  # documents per query; the agent's prompt holds a handful


def parse_request(body: object, default_topk: int) -> tuple[list[str], int, bool]:
    """Validate a /retrieve body; ValueError names the field and says what is wrong."""
    if not isinstance(body, dict):
        raise ValueError(f"body must be a JSON object, got {type(body).__name__}")
    queries = body.get("queries")
    if not isinstance(queries, list):
        raise ValueError(f"'queries' must be a list of strings, got {type(queries).__name__}")
    if len(queries) > MAX_QUERIES:
        raise ValueError(f"'queries' has {len(queries)} entries, at most {MAX_QUERIES} per request")
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise ValueError(f"'queries[{i}]' must be a string, got {type(q).__name__}")
        if len(q) > MAX_QUERY_CHARS:
            raise ValueError(f"'queries[{i}]' has {len(q)} characters, at most {MAX_QUERY_CHARS}")
    topk = body.get("topk")
    topk = default_topk if topk is None else topk
    if type(topk) is not int or not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"'topk' must be an integer in [1, {MAX_TOPK}], got {topk!r:.80}")
    return_scores = body.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise ValueError(f"'return_scores' must be a boolean, got {return_scores!r:.80}")
    return queries, topk, return_scores


def make_app(retriever: BM25Retriever, *, default_topk: int = 3) -> web.Application:
    async def retrieve(request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, nesting too deep
            return web.json_response({"error": f"invalid JSON body: {exc}"}, status=400)
        try:
            queries, topk, return_scores = parse_request(body, default_topk)
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        docs, scores = await asyncio.to_thread(retriever.search, queries, topk)
        if return_scores:
            result = [[{"document": d, "score": s} for d, s in zip(ds, ss)] for ds, ss in zip(docs, scores)]
        else:
            result = docs
        return web.json_response({"result": result})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "num_docs": len(retriever.docs)})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/retrieve", retrieve)
    app.router.add_get("/health", health)
    return app


async def serve(corpus: str, *, host: str, port: int, topk: int) -> None:
    retriever = BM25Retriever.from_jsonl(corpus)
    runner = web.AppRunner(make_app(retriever, default_topk=topk), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # the real port when --port 0
    print(json.dumps({"url": f"http://{host}:{bound}/retrieve", "num_docs": len(retriever.docs)}), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m asyncrl.agent.tools.retrieval_server", description="Search-R1 /retrieve over BM25"
    )
    ap.add_argument("--corpus", required=True, help="Search-R1 corpus JSONL ({id, contents})")
    ap.add_argument("--port", type=int, required=True, help="TCP port (0 = any free port)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--topk", type=int, default=3, help="topk when a request does not say")
    args = ap.parse_args(argv)
    try:
        asyncio.run(serve(args.corpus, host=args.host, port=args.port, topk=args.topk))
    except KeyboardInterrupt:
        pass
    except ValueError as exc:
        print(f"retrieval_server: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
